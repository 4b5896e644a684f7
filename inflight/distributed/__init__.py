"""Tensor parallelism across the GPUs of one machine: the rank group and its collectives
(`group`), starting, following and stopping the ranks (`launch`)."""

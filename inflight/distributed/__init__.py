"""Tensor parallelism across the GPUs of one machine: the rank group and its collectives
(`group`), and a step as the plain message rank 0 sends the other ranks (`step_plan`). Starting
and following the ranks is the runner's (`inflight.runner.ranks`)."""

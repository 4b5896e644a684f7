"""What the in-process GPU check scripts share (bench_gpu_checks.py, bench_gpu_mixed.py): their
log, the device they run on, an engine over a random-weight model of a public shape, and where
their results go. The measurements themselves are in bench_gpu_runs.py."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from bench_gpu_runs import build_hf, free_memory, int4_checkpoint, make_engine


def log(msg: str) -> None:
    print(msg, flush=True)


def open_device(name: str) -> torch.device | None:
    """The device to run on, its name logged (CUDA); None, with why, if CUDA is asked for and
    absent (the caller exits with status 2)."""
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available here; use --device cpu --shapes tiny for a dry run", file=sys.stderr)
        return None
    if device.type == "cuda":
        log(f"{torch.cuda.get_device_name(device)} | torch {torch.__version__}")
    return device


def start_random_engine(shape: str, device: torch.device, max_batch_size: int, max_seq_len: int,
                        during_start_up: contextlib.AbstractContextManager = contextlib.nullcontext(),
                        **overrides):
    """An engine (auto settings, ExecutorConfig `overrides`) over a random-weight model of
    `shape`, bf16 on CUDA, float32 elsewhere. `during_start_up` is entered around the engine's
    start-up alone (the weights are built before it). Returns the engine, the vocabulary size
    and the start-up seconds."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf, folder = build_hf(shape, device, dtype)
    weights = dict(hf.state_dict())
    vocab = hf.config.vocab_size
    del hf
    free_memory(device)
    if overrides.get("quantization") == "w4a16":  # a checkpoint's format, not a quantization at load
        folder = int4_checkpoint(weights, folder)
        overrides.pop("quantization")
    start = time.perf_counter()
    with during_start_up:
        engine = make_engine(folder, weights, device, str(dtype).removeprefix("torch."), max_batch_size,
                             max_seq_len, **overrides)
    del weights  # the engine holds what it loaded; the HF tensors go with the last reference
    return engine, vocab, time.perf_counter() - start


def write_results(out: str, name: str, results, markdown: str | None = None) -> Path:
    """`results` as indented JSON in `out`/`name` (the folder made if need be), and `markdown`
    (a report) next to it with the suffix .md."""
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(results, indent=1))
    if markdown is not None:
        path.with_suffix(".md").write_text(markdown + "\n")
    return path

"""A tensor-parallel rank on the CPU that runs the start-up and step protocol of a CUDA rank.

On CUDA every rank runs, besides the steps rank 0 sends: the warm-up step at the largest batch
(KV cache sizing), the graph capture (one eager forward per mixed-step and decode bucket, with
the model's collectives, before each capture), the precompile steps (CUDA + Triton backend),
and decode and mixed steps replayed from the graph runner's static buffers; overlapped steps
broadcast the sampled ids. On the CPU none of that runs by default. `apply` forces each of them on, in a CUDA rank's
order, over the Triton attention backend under its interpreter (the graph runner's backend):
the runner's un-captured path is the captured body run eagerly over the same static buffers.
The test config turns `enable_overlap_scheduler` on itself (it travels to the other ranks).

`apply` also records every collective of this rank, in order, with its sizes and dtypes
(`TRACE`; the other ranks write theirs to `$INFLIGHT_TEST_TP_TRACE/rank{r}.json` at their
teardown), so a test can check that each one pairs up across ranks: gloo tolerates some
mismatches (a broadcast of another size) that NCCL does not.

Spawned ranks run `rank_main` (set as `inflight.runner.ranks._rank_main` in rank 0, it
is pickled by name), which applies the same patches in the new process first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

import torch  # noqa: E402

from inflight.distributed.group import TensorParallel  # noqa: E402
from inflight.model import ops as ops_module  # noqa: E402
from inflight.runner import ranks as launch  # noqa: E402
from inflight.runner import worker as worker_module  # noqa: E402
from inflight.runner.cuda_graph import CudaGraphRunner  # noqa: E402
from inflight.runner.precompile import precompile  # noqa: E402

TRACE_ENV = "INFLIGHT_TEST_TP_TRACE"
TRACE: list[list] = []  # this process's collectives, in order


def _capture_eagerly(self: CudaGraphRunner, kv_caches) -> None:
    """`capture` without CUDA: the eager forward per bucket, largest first (mixed-step token
    buckets, then decode batch buckets), that capture runs before each graph (the capture
    itself communicates nothing; its replays do, like these un-captured buckets' runs)."""
    self.bind(kv_caches)
    mixed = getattr(self, "mixed", None)
    if mixed is not None:
        for num_tokens in reversed(mixed.token_buckets):
            mixed.buckets[num_tokens].pad_all()
            mixed._forward(mixed.buckets[num_tokens])
    for batch_size in reversed(self.batch_sizes):
        bucket = self.buckets[batch_size]
        bucket.pad_all()
        self._forward(bucket)


def _with_warm_up(original):
    def num_kv_blocks(self, config, peak_bytes):  # CUDA runs the warm-up just before
        self.warm_up(config.max_batch_size, self.max_num_tokens)
        return original(self, config, peak_bytes)
    return num_kv_blocks


def _with_precompile(original):
    def capture_graphs(self, explicit):  # CUDA + Triton precompiles right after the capture
        original(self, explicit)
        precompile(self)
    return capture_graphs


def _traced(name, original, describe):
    def method(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.size > 1:
            TRACE.append([name, *describe(args, result)])
        return result
    return method


def _tensor(x: torch.Tensor) -> list:
    return [list(x.shape), str(x.dtype)]


def _traced_close(original):
    def close(self, *args, **kwargs):
        if self.size > 1:
            TRACE.append(["close"])
            folder = os.environ.get(TRACE_ENV)
            if folder and self.rank > 0:
                (Path(folder) / f"rank{self.rank}.json").write_text(json.dumps(TRACE))
        return original(self, *args, **kwargs)
    return close


def apply(setattr_=setattr) -> None:
    """Forces the CUDA-only start-up and step paths on in this process (see the module
    docstring). `setattr_`: pytest's monkeypatch.setattr in rank 0, so the test undoes it."""
    setattr_(worker_module, "resolve_attention_backend", lambda *args: "triton")
    # The elementwise ops stay torch's: they hold no collective, and interpreted they would
    # cost most of the test's time (the attention kernels are the graph runner's, so they stay).
    setattr_(ops_module, "_OPS", {**ops_module._OPS, "triton": ops_module.TorchOps})
    setattr_(worker_module, "uses_cuda_graphs", lambda requested, device, supported: supported)
    setattr_(CudaGraphRunner, "capture", _capture_eagerly)
    setattr_(worker_module.Worker, "_num_kv_blocks", _with_warm_up(worker_module.Worker._num_kv_blocks))
    setattr_(worker_module.Worker, "_capture_graphs",
             _with_precompile(worker_module.Worker._capture_graphs))
    tp = TensorParallel
    setattr_(tp, "all_reduce", _traced("all_reduce", tp.all_reduce, lambda a, r: _tensor(a[0])))
    setattr_(tp, "all_gather_last", _traced("all_gather", tp.all_gather_last, lambda a, r: _tensor(a[0])))
    setattr_(tp, "broadcast_from_leader",
             _traced("broadcast", tp.broadcast_from_leader, lambda a, r: _tensor(a[0])))
    setattr_(tp, "min_over_ranks", _traced("min", tp.min_over_ranks, lambda a, r: []))
    setattr_(tp, "send_message", _traced(
        "message", tp.send_message, lambda a, r: [a[0], 0 if len(a) < 2 or a[1] is None else a[1].numel()]))
    setattr_(tp, "receive_message", _traced(
        "message", tp.receive_message, lambda a, r: [r[0], 0 if r[1] is None else r[1].numel()]))
    setattr_(tp, "close", _traced_close(tp.close))


def rank_main(rank: int, size: int, port: int, model_dir: str, config) -> None:
    """A spawned rank's entry point: the CUDA paths forced on, then the real rank's."""
    apply()
    launch._rank_main(rank, size, port, model_dir, config)

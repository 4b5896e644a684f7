"""The tensor-parallel group of one engine: its ranks, its collectives, its control channel.

Two process groups over the same ranks:
- `device_group` carries the model's collectives on the model's device (NCCL on CUDA, so
  they are captured into the decode CUDA graphs; gloo on the CPU);
- `cpu_group` (gloo) carries rank 0's step messages: small int64 host tensors
  (`inflight.distributed.step_plan.StepPlan.pack`), never pickled Python objects.

With one rank there is no group at all (`TensorParallel.single()`): every collective is the
identity, so tp=1 runs exactly the code it ran before tensor parallelism existed.
`rank_device` and `check_devices` say which device each rank runs on.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ensemble.errors import ConfigError
from inflight.api.config import ExecutorConfig

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer before it fails (start-up included: a rank
# loading a 70B shard from a network disk takes minutes). INFLIGHT_TP_TIMEOUT_S overrides.
DEFAULT_TIMEOUT_S = 1800
# How long the collective teardown (`TensorParallel.close`) waits for a peer, then each step of it.
CLOSE_TIMEOUT_S = 30

# All-reduces of up to this many bytes go through peer-mapped buffers (`OneShotAllReduce`): a
# decode step's activations (8 KiB a row at hidden size 4096). Larger ones, prefill's, use NCCL.
ONE_SHOT_MAX_BYTES = 1 << 20

# Step messages: a header [kind, payload length] then the payload.
MSG_STEP = 1
MSG_STOP = 2
MSG_LORA = 3  # a LoRA adapter the next step loads: [key, packed adapter] (inflight.lora.adapter)


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 now (the rendezvous of the engine's ranks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=float(os.environ.get("INFLIGHT_TP_TIMEOUT_S", DEFAULT_TIMEOUT_S)))


class OneShotAllReduce:
    """Sums small tensors over the ranks in one kernel through torch's symmetric memory: each
    rank copies its input into a buffer that every peer has mapped, then reads all ranks'
    buffers and adds them (`symm_mem::one_shot_all_reduce_copy`; peer-to-peer over NVLink,
    multicast not used). NCCL's ring spends its time on latency at decode sizes: the 8B shape's
    64 all-reduces a step looked like tp=2's gap to a 2x step (they were not: `_one_shot`).
    Captured in CUDA graphs like any kernel. Built on every rank at once (the rendezvous is
    collective)."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES) -> None:
        import torch.distributed._symmetric_memory as symm_mem
        self.group_name = group.group_name
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes
                and x.dtype in (torch.bfloat16, torch.float16, torch.float32))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # A view at the buffer's start: the op finds the peers' mappings by its address.
        buf = self.buffer.view(x.dtype)[:x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x, "sum", self.group_name)


def _one_shot(group: Any, device: torch.device) -> OneShotAllReduce | None:
    """The one-shot all-reduce on CUDA with INFLIGHT_TP_ONE_SHOT=1, else None (NCCL for every
    size; also where torch's symmetric memory is missing or fails to set up). Off by default:
    on 2 H100s (2026-11-28, 8B shape, bench/gpu_tp.py --bench) it gave the same step as NCCL,
    4.19 against 4.18 ms at batch 1 and 5.27 against 5.22 ms at batch 64."""
    if device.type != "cuda" or os.environ.get("INFLIGHT_TP_ONE_SHOT", "0") != "1":
        return None
    try:
        return OneShotAllReduce(group, device)
    except (ImportError, RuntimeError, AttributeError) as exc:
        logger.warning("one-shot all-reduce unavailable (%s); NCCL for every all-reduce", exc)
        return None


@dataclass
class TensorParallel:
    """This process's place in the engine's tensor-parallel group."""

    rank: int = 0
    size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    one_shot: OneShotAllReduce | None = None

    @classmethod
    def single(cls) -> "TensorParallel":
        return cls()

    @classmethod
    def init(cls, rank: int, size: int, port: int, device: torch.device) -> "TensorParallel":
        """Joins the rendezvous on 127.0.0.1:`port` as `rank` of `size` (blocks until all have)."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=_timeout(), **kwargs)
        device_group = dist.group.WORLD
        cpu_group = dist.new_group(backend="gloo", timeout=_timeout()) if backend == "nccl" else device_group
        one_shot = _one_shot(device_group, device)
        logger.info("tensor-parallel rank %d of %d on %s (%s%s)", rank, size, device, backend,
                    ", one-shot all-reduce up to 1 MiB" if one_shot else "")
        return cls(rank, size, device_group, cpu_group, one_shot)

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ----- the model's collectives (inside CUDA graphs on CUDA) -------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks: `x` itself summed in place (NCCL, gloo), or a new tensor
        (the one-shot path, for small tensors on CUDA). Callers use the returned tensor."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.fits(x):
                return self.one_shot(x)
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., N] per rank -> [..., size * N], rank r's block at columns r*N..(r+1)*N."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:
            out = x.new_empty((self.size, *x.shape))  # one NCCL call: [size, ..., N]
            dist.all_gather_into_tensor(out, x, group=self.device_group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_leader(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (device group; in place)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.device_group)
        return x

    # ----- host-side control ----------------------------------------------------------------

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (start-up: KV blocks every rank can hold)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def send_message(self, kind: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: a message to every other rank (int64 header, then the int64 payload)."""
        n = 0 if payload is None else payload.numel()
        dist.broadcast(torch.tensor([kind, n], dtype=torch.int64), src=0, group=self.cpu_group)
        if n:
            dist.broadcast(payload, src=0, group=self.cpu_group)

    def receive_message(self) -> tuple[int, torch.Tensor | None]:
        """Other ranks: the next message of rank 0 (blocks)."""
        header = torch.empty(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.cpu_group)
        kind, n = int(header[0]), int(header[1])
        payload = None
        if n:
            payload = torch.empty(n, dtype=torch.int64)
            dist.broadcast(payload, src=0, group=self.cpu_group)
        return kind, payload

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Collective teardown: every rank calls it at about the same time (rank 0 right after
        its stop message, the others on receiving it), never after waiting for a peer to exit.

        NCCL's communicator teardown waits for every rank's (a rank 0 that first waited for
        rank 1 to exit, while rank 1 waited in its teardown for rank 0's, deadlocked: the first
        2-GPU run). gloo's is local, so a barrier on the control group comes first and makes
        that pairing explicit on every backend (a CPU run shows an ordering bug too); it is
        bounded, so a peer that never arrives fails it instead of hanging it. True when the
        teardown completed; False leaves the groups to `destroy` once the peers are ended.
        """
        if self.size == 1 or not dist.is_initialized():
            return True
        try:
            dist.monitored_barrier(group=self.cpu_group, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_all_ranks=True)
        except RuntimeError as exc:
            logger.error("tensor-parallel rank %d: a peer did not come to the teardown in %.0f s: %s",
                         self.rank, timeout_s, exc)
            return False
        return self.destroy(timeout_s)

    def destroy(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Releases this process's groups; True when done (or nothing to do), False when the
        gloo teardown did not return within `timeout_s` (left to the process exit).

        NCCL groups are left to the process exit, which ends every rank's communicators at
        once: on 2 H200s (2026-11-23) the graceful destroy did not return in 30 s with both
        ranks in it (their communicators are captured in CUDA graphs), then failed "invalid
        argument", and an abort after the barrier hung too. The engine's processes end with
        `os._exit` after stopping, so nothing waits on them; one tp > 1 engine per process."""
        if self.size == 1 or not dist.is_initialized():
            return True
        if dist.get_backend(self.device_group) == "nccl":
            logger.info("tensor-parallel rank %d: NCCL communicators left to the process exit", self.rank)
            return True
        done = threading.Thread(target=dist.destroy_process_group, name="tp-teardown", daemon=True)
        try:
            done.start()
        except RuntimeError:  # at interpreter exit (atexit) Python 3.12 starts no new thread
            dist.destroy_process_group()
            return True
        done.join(timeout_s)
        if done.is_alive():
            logger.error("tensor-parallel rank %d: destroying the process groups did not finish in "
                         "%.0f s; left to the process exit", self.rank, timeout_s)
            return False
        return True


def rank_device(config: ExecutorConfig, rank: int) -> torch.device:
    """The device rank `rank` runs on: the CPU (gloo) or its GPU of `gpu_device_ids`."""
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", config.parallel_config.rank_device_ids()[rank])


def check_devices(config: ExecutorConfig) -> None:
    """ConfigError when the GPUs the ranks are to run on are not there."""
    device = rank_device(config, 0)
    if device.type != "cuda":
        return
    ids = config.parallel_config.rank_device_ids()
    visible = torch.cuda.device_count()
    missing = [i for i in ids if i >= visible]
    if missing:
        raise ConfigError(
            f"tensor_parallel_size {config.tensor_parallel_size} runs on GPUs "
            f"{','.join(map(str, ids))} (gpu_device_ids) but this process sees {visible} GPU(s)"
            f" (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
            f"GPU(s) {','.join(map(str, missing))} are not there")

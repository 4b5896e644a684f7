"""Starting and stopping the engine's tensor-parallel ranks; the other ranks' step loop.

`start_worker` builds the engine's worker: at tensor_parallel_size 1 a plain `Worker`; above,
rank 0's, after starting the other ranks, with their handle (`Worker.ranks`). The process that
builds the engine (the Triton model instance, or its engine process) is rank 0: it holds the
scheduler and samples. `start_ranks` spawns ranks 1..N-1 with
torch.multiprocessing (spawn: no CUDA state is inherited), and every rank meets at a
rendezvous on a free loopback port. Each other rank builds its own `Worker` (its shard of the
weights, its KV heads, its CUDA graphs) and then loops in `follow`: receive rank 0's step
message (`StepPlan`, int64), run the same model step, join the collectives. Rank 0 stops them
with a stop message (`Ranks.stop`), at shutdown or when the interpreter exits; then every rank
tears the group down at once (`TensorParallel.close`: collective with NCCL), and only then does
rank 0 wait for their processes.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing import connection as mp_connection
from pathlib import Path
from typing import Mapping

import torch
import torch.multiprocessing as mp

from inflight.api.config import ExecutorConfig
from inflight.distributed.group import (
    MSG_LORA,
    MSG_STEP,
    MSG_STOP,
    TensorParallel,
    check_devices,
    free_loopback_port,
    rank_device,
)
from inflight.distributed.step_plan import StepPlan
from inflight.model.config import ModelConfig
from inflight.model.sharding import check_divisible
from inflight.runner.step_inputs import StepOrder
from inflight.runner.worker import Worker

logger = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 30


def _python_executable() -> str:
    """The interpreter for spawned ranks. Inside a Triton python stub `sys.executable` may be
    the stub binary; its environment's python is under `sys.prefix`."""
    if Path(sys.executable).name.startswith("python"):
        return sys.executable
    candidate = Path(sys.prefix) / "bin" / "python3"
    return str(candidate) if candidate.exists() else "python3"


class Ranks:
    """Rank 0's handle on the other ranks' processes."""

    def __init__(self, tp: TensorParallel, processes: list) -> None:
        self.tp = tp
        self.processes = processes
        self._stopped = False
        self._lock = threading.Lock()
        self.stopping = threading.Event()  # set once a stop or kill begins
        atexit.register(self.stop)
        self._watch()

    def _watch(self) -> None:
        """Logs a rank that dies while the engine runs: rank 0's next collective then fails
        (gloo at once, NCCL at its timeout), which fails the engine instead of hanging it
        silently. A watcher waits on the process's sentinel and reads its exit code only when
        no stop is under way: two threads reaping one process can lose its exit code."""
        def watch(p):
            mp_connection.wait([p.sentinel])
            if not self.stopping.is_set() and p.exitcode not in (0, None):
                logger.error("tensor-parallel rank process %s (pid %d) exited with code %s",
                             p.name, p.pid, p.exitcode)
        for p in self.processes:
            threading.Thread(target=watch, args=(p,), name=f"watch-{p.name}", daemon=True).start()

    def send_step(self, plan: StepPlan) -> None:
        self.tp.send_message(MSG_STEP, plan.pack())

    def send_adapter(self, key: int, packed: torch.Tensor) -> None:
        """A LoRA adapter (`inflight.lora.adapter.pack_adapter`) the next step loads."""
        self.tp.send_message(MSG_LORA, torch.cat([torch.tensor([key], dtype=torch.int64), packed]))

    def kill(self) -> None:
        """Ends the other ranks at once (rank 0's start-up failed: they cannot be told)."""
        with self._lock:
            self._stopped = True
            self.stopping.set()
        for p in self.processes:
            p.kill()
            p.join()

    def stop(self) -> None:
        """Tells the other ranks to exit, tears the group down together with them, then waits
        for their processes (idempotent). The teardown is collective (`TensorParallel.close`):
        it must come before the wait for their exit, never after it."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            self.stopping.set()
        start = time.monotonic()
        told = False
        if all(p.is_alive() for p in self.processes):
            try:
                self.tp.send_message(MSG_STOP)
                told = True
            except Exception:  # a rank is gone: the group is broken; the processes are ended below
                logger.exception("could not send the stop message to the tensor-parallel ranks")
        else:
            logger.error("a tensor-parallel rank has exited already: ending the others")
        # Paired with each rank's own close, right after its stop message.
        closed = told and self.tp.close()
        for p in self.processes:
            p.join(_STOP_TIMEOUT_S if told else 0)
            if p.is_alive():
                logger.error("tensor-parallel rank (pid %d) did not stop; killing it", p.pid)
                p.kill()
                p.join()
        if not closed:  # the peers are gone: this process's side alone (a later engine may start)
            self.tp.destroy()
        logger.info("tensor-parallel ranks stopped in %.1f s (exit codes %s)", time.monotonic() - start,
                    [p.exitcode for p in self.processes])


def start_worker(model_dir: str, config: ExecutorConfig,
                 weights: Mapping[str, torch.Tensor] | None = None) -> Worker:
    """The engine's worker; at tensor_parallel_size > 1 rank 0's, the other ranks started and
    following (`weights` in memory need one rank: the others could not load them)."""
    if config.tensor_parallel_size == 1:
        return Worker(model_dir, config, weights)
    if weights is not None:
        raise ValueError("weights handed over in memory need tensor_parallel_size 1; "
                         "write them to a folder for tensor parallelism")
    check_divisible(ModelConfig.from_dir(model_dir), config.tensor_parallel_size)
    tp, ranks = start_ranks(model_dir, config)
    try:
        # Start-up steps (warm-up, precompile) run on every rank at once, each its own: rank 0
        # sends steps only once every rank is built and following.
        worker = Worker(model_dir, config, tp=tp)
    except BaseException:
        ranks.kill()
        raise
    worker.ranks = ranks
    return worker


def start_ranks(model_dir: str, config: ExecutorConfig) -> tuple[TensorParallel, Ranks]:
    """Spawns ranks 1..N-1 and joins the group as rank 0 (blocks until every rank has)."""
    size = config.tensor_parallel_size
    check_devices(config)
    port = free_loopback_port()
    ctx = mp.get_context("spawn")
    ctx.set_executable(_python_executable())
    processes = []
    for rank in range(1, size):
        p = ctx.Process(target=_rank_main, args=(rank, size, port, model_dir, config),
                        name=f"inflight-tp-rank{rank}", daemon=True)
        p.start()
        processes.append(p)
    try:
        tp = TensorParallel.init(0, size, port, rank_device(config, 0))
    except BaseException:
        for p in processes:
            p.kill()
        raise
    return tp, Ranks(tp, processes)


def _rank_main(rank: int, size: int, port: int, model_dir: str, config: ExecutorConfig) -> None:
    """Entry point of a spawned rank: join, build the worker, follow rank 0 until stopped."""
    logging.basicConfig(level=logging.INFO, format=f"[tp rank {rank}] %(levelname)s %(name)s: %(message)s")
    # A hang must be diagnosable: a fatal signal (an NCCL abort) prints this rank's Python
    # stack, and so does SIGUSR1 (a watchdog's request, e.g. bench/gpu_tp.py's), without stopping it.
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    device = rank_device(config, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    tp = TensorParallel.init(rank, size, port, device)
    try:
        worker = Worker(model_dir, config, tp=tp)
        follow(worker)
    except BaseException:
        logger.exception("tensor-parallel rank %d failed", rank)
        # Exit now, without a graceful teardown (which would wait for peers): the closed sockets
        # make rank 0's next message or collective fail at once instead of waiting it out.
        os._exit(1)
    logger.info("tensor-parallel rank %d: stop message received; tearing down", rank)
    closed = tp.close()  # collective: rank 0 closes right after its stop message
    logging.shutdown()
    # No interpreter teardown: NCCL communicators are left to the process exit (see
    # TensorParallel.destroy), and a group's destructor would try to tear them down again.
    os._exit(0 if closed else 1)


def follow(worker) -> None:
    """A non-leader rank's loop: run every step rank 0 sends, until it sends stop."""
    while True:
        kind, payload = worker.tp.receive_message()
        if kind == MSG_STOP:
            return
        if kind == MSG_LORA:
            worker.receive_adapter(int(payload[0]), payload[1:])
            continue
        if kind != MSG_STEP:
            raise RuntimeError(f"unknown tensor-parallel message kind {kind}")
        worker.launch(StepOrder(StepPlan.unpack(payload)))

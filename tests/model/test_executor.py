"""The threaded `Executor` (TensorRT-LLM's interface) over a tiny random Llama checkpoint.

Steps are made deterministic where timing matters with a `StepGate` on `engine.fault_hook`: the
engine thread blocks at the start of each step until the test lets it through.
"""

from __future__ import annotations

import datetime
import threading
import time

import pytest

from inflight.api.config import ExecutorConfig
from inflight.api.types import FinishReason, QueueFullError, Request, RequestError, Response
from inflight.fatal_errors import EngineFatalError
from inflight.hosts.executor import Executor
from tests.model.engine_utils import DEFAULT_KV, final, make_engine, output_tokens, run

PROMPTS = [[1, 17, 250, 33], [1, 5], list(range(3, 30)), [7, 300, 301, 7, 300, 9, 9]]
NUM_NEW = 12



@pytest.fixture(scope="module")
def expected(tiny_dir) -> list[list[int]]:
    """Each prompt's greedy continuation, run alone on a plain engine."""
    engine = make_engine(tiny_dir)
    return [output_tokens(run(engine, [Request(p, NUM_NEW)])[0])[len(p):] for p in PROMPTS]


@pytest.fixture
def make_executor(tiny_dir):
    executors = []

    def make(**config) -> Executor:
        config.setdefault("kv_cache_config", DEFAULT_KV)
        executor = Executor(str(tiny_dir), executor_config=ExecutorConfig(dtype="float32", device="cpu",
                                                                           **config))
        executors.append(executor)
        return executor

    yield make
    for executor in executors:
        executor.engine.fault_hook = None
        executor.shutdown()


class StepGate:
    """`engine.fault_hook` that holds every step until `allow` lets it run."""

    def __init__(self):
        self._permits = threading.Semaphore(0)
        self.entered = threading.Event()  # set when a step is waiting at the gate

    def __call__(self, batch) -> None:
        self.entered.set()
        if not self._permits.acquire(timeout=30):
            raise RuntimeError("StepGate: the test never let this step run")
        self.entered.clear()

    def allow(self, num_steps: int = 1) -> None:
        for _ in range(num_steps):
            self._permits.release()


def collect(executor: Executor, ids, timeout: float = 60.0) -> dict[int, list[Response]]:
    """Awaits responses until every id in `ids` had its final (or error) response."""
    pending, got = set(ids), {i: [] for i in ids}
    deadline = time.monotonic() + timeout
    while pending:
        assert time.monotonic() < deadline, f"no final response for {sorted(pending)}"
        for response in executor.await_responses(timeout=0.5):
            got[response.request_id].append(response)
            if response.has_error() or response.result.is_final:
                pending.discard(response.request_id)
    return got


def wait_idle(executor: Executor, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while executor.engine.has_unfinished() or executor._incoming:
        assert time.monotonic() < deadline, "executor never went idle"
        time.sleep(0.01)
    bm = executor.engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks


def test_enqueue_from_several_threads(make_executor, expected):
    executor = make_executor()
    barrier = threading.Barrier(4)
    enqueued: dict[int, tuple[int, bool]] = {}  # request id -> (prompt index, streaming)
    lock = threading.Lock()

    def client(thread_index: int) -> None:
        barrier.wait()
        for i in range(5):
            prompt_index = (thread_index + i) % len(PROMPTS)
            streaming = i % 2 == 1
            request = Request(PROMPTS[prompt_index], NUM_NEW, streaming=streaming,
                              client_id=100 * thread_index + i)
            [request_id] = executor.enqueue_requests([request])
            with lock:
                enqueued[request_id] = prompt_index, streaming

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(enqueued) == 20
    results = collect(executor, enqueued)
    for request_id, responses in results.items():
        tokens = output_tokens(responses)  # asserts one final response, last
        prompt_index, streaming = enqueued[request_id]
        prompt, ref = PROMPTS[prompt_index], expected[prompt_index]
        assert tokens == (ref if streaming else prompt + ref)  # streams carry new tokens only
        assert len(responses) == (NUM_NEW if streaming else 1)
        assert len({r.client_id for r in responses}) == 1
    assert {r[0].client_id for r in results.values()} == {100 * t + i for t in range(4) for i in range(5)}
    wait_idle(executor)


def test_await_responses_returns_within_timeout_when_idle(make_executor):
    executor = make_executor()
    # It waits (not at once) and comes back (not for ever); the upper bound leaves room for a
    # loaded machine's scheduling, it is not a speed target.
    for timeout in (0.2, datetime.timedelta(milliseconds=100)):
        start = time.monotonic()
        assert executor.await_responses(timeout=timeout) == []
        assert 0.05 <= time.monotonic() - start < 2.0
    start = time.monotonic()
    assert executor.await_responses(timeout=0.1, id=12345) == []
    assert time.monotonic() - start < 2.0
    [request_id] = executor.enqueue_requests([Request([1, 2, 3], 3)])
    [response] = collect(executor, [request_id])[request_id]
    assert response.result.is_final and executor.get_num_responses_ready() == 0


def test_iteration_stats_drain(make_executor):
    executor = make_executor(iter_stats_max_iterations=1000)
    ids = executor.enqueue_requests([Request(p, 5) for p in PROMPTS])
    collect(executor, ids)
    wait_idle(executor)
    stats = executor.get_latest_iteration_stats()
    iters = [s.iter for s in stats]
    assert iters == list(range(1, len(iters) + 1)) and len(iters) >= 5
    assert stats[0].inflight_batching_stats.num_context_requests == len(PROMPTS)
    assert stats[-1].num_completed_requests == len(PROMPTS)
    assert executor.get_latest_iteration_stats() == []
    # Waking the loop without running a step (an unknown cancel) publishes nothing new.
    executor.cancel_request(12345)
    time.sleep(0.2)
    assert executor.get_latest_iteration_stats() == []
    assert executor.get_current_stats().iter == iters[-1]


def test_iteration_stats_keep_the_latest(make_executor):
    executor = make_executor(iter_stats_max_iterations=3)
    collect(executor, executor.enqueue_requests([Request([1, 2], 8)]))
    wait_idle(executor)
    assert [s.iter for s in executor.get_latest_iteration_stats()] == [6, 7, 8]


def test_cancel_request_mid_generation_and_while_queued(make_executor, expected):
    executor = make_executor()
    gate = StepGate()
    executor.engine.fault_hook = gate
    streamed, other = executor.enqueue_requests([Request(PROMPTS[0], NUM_NEW, streaming=True),
                                                 Request(PROMPTS[1], NUM_NEW)])
    gate.allow(3)
    got = []
    while len(got) < 3:
        got += executor.await_responses(timeout=5, id=streamed)
    assert gate.entered.wait(5)  # the engine waits at step 4
    queued = executor.enqueue_request(Request(PROMPTS[2], NUM_NEW))  # not admitted yet
    executor.cancel_request(streamed)
    executor.cancel_request(queued)
    gate.allow(1)  # step 4 runs, then the loop applies both cancellations
    results = collect(executor, [streamed, queued])
    cancelled = got + results[streamed]
    assert final(cancelled).result.finish_reasons == [FinishReason.CANCELLED]
    assert output_tokens(cancelled) == expected[0][:4]
    assert output_tokens(results[queued]) == PROMPTS[2]  # cancelled before any step
    assert final(results[queued]).result.finish_reasons == [FinishReason.CANCELLED]
    executor.engine.fault_hook = None
    gate.allow(100)
    assert output_tokens(collect(executor, [other])[other]) == PROMPTS[1] + expected[1]
    wait_idle(executor)


def test_failed_step_fails_its_requests_only(make_executor, expected):
    executor = make_executor()
    failed_batches = []

    def fail_once(batch):
        if not failed_batches:
            failed_batches.append([s.seq.request_id for s in batch.scheduled])
            raise RuntimeError("injected fault")

    executor.engine.fault_hook = fail_once
    ids = executor.enqueue_requests([Request(PROMPTS[0], NUM_NEW), Request(PROMPTS[1], NUM_NEW)])
    results = collect(executor, ids)
    assert sorted(failed_batches[0]) == sorted(ids)
    for request_id in ids:
        [response] = results[request_id]
        assert response.has_error() and response.result is None
        assert response.error_msg == "engine step failed: RuntimeError: injected fault"
    wait_idle(executor)
    assert executor.is_healthy and executor.can_enqueue_requests()
    later = executor.enqueue_requests([Request(p, NUM_NEW) for p in PROMPTS])
    results = collect(executor, later)
    for prompt, ref, request_id in zip(PROMPTS, expected, later):
        assert output_tokens(results[request_id]) == prompt + ref
    wait_idle(executor)


def test_fatal_error_fails_every_request_and_stops_the_executor(make_executor):
    executor = make_executor()
    entered, release = threading.Event(), threading.Event()

    def fatal(batch):
        entered.set()
        release.wait(10)
        raise EngineFatalError("device lost")

    executor.engine.fault_hook = fatal
    running = executor.enqueue_request(Request([1, 2], 10, client_id=7))
    assert entered.wait(5)
    queued = executor.enqueue_request(Request([3, 4], 10, client_id=8))  # validated, not admitted yet
    release.set()
    results = collect(executor, [running, queued])
    for request_id in (running, queued):
        [response] = results[request_id]
        assert response.error_msg == "the engine stopped: EngineFatalError: device lost"
    assert (results[running][0].client_id, results[queued][0].client_id) == (7, 8)
    executor._thread.join(5)
    assert not executor.is_healthy and not executor.can_enqueue_requests()
    with pytest.raises(RuntimeError, match="the engine stopped: EngineFatalError: device lost"):
        executor.enqueue_request(Request([1, 2], 2))


def test_queue_full(make_executor):
    executor = make_executor(max_queue_size=2, max_batch_size=1)
    # One call past the limit is rejected whole, before the engine runs.
    with pytest.raises(QueueFullError, match="Maximum queue size of 2 has been reached"):
        executor.enqueue_requests([Request([1, 2], 4) for _ in range(3)])
    assert not executor._incoming and not executor.engine.has_unfinished()
    gate = StepGate()
    executor.engine.fault_hook = gate
    running = executor.enqueue_request(Request([1, 2], 4))
    assert gate.entered.wait(5)  # it runs (the batch holds 1), the queue is empty
    queued = executor.enqueue_requests([Request([3, 4], 4), Request([5, 6], 4)])
    with pytest.raises(QueueFullError):
        executor.enqueue_request(Request([7, 8], 4))
    executor.engine.fault_hook = None
    gate.allow(100)
    results = collect(executor, [running, *queued])
    assert all(len(output_tokens(r)) == 6 for r in results.values())
    wait_idle(executor)


def test_bad_request_rejects_the_whole_call(make_executor):
    executor = make_executor()
    with pytest.raises(RequestError, match="outside the vocabulary"):
        executor.enqueue_requests([Request([1, 2], 4), Request([1, 100000], 4)])
    assert not executor._incoming
    [request_id] = executor.enqueue_requests([Request([1, 2], 4)])
    assert len(output_tokens(collect(executor, [request_id])[request_id])) == 6


def test_shutdown_joins_the_thread(make_executor):
    executor = make_executor()
    [request_id] = executor.enqueue_requests([Request([1, 2], 2)])
    collect(executor, [request_id])
    executor.shutdown()
    assert not executor._thread.is_alive() and not executor.can_enqueue_requests()
    with pytest.raises(RuntimeError, match="the executor has been shut down"):
        executor.enqueue_requests([Request([1, 2], 2)])
    start = time.monotonic()
    assert executor.await_responses(timeout=5) == []  # returns at once after shutdown
    assert time.monotonic() - start < 1.0
    executor.shutdown()  # idempotent

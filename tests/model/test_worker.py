"""The worker's step split (prepare inputs → run model → sample) and its warm-up step."""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.core.outputs import ScheduledSequence, SchedulerOutput
from inflight.core.sequence import Sequence
from inflight.runner.step_inputs import StepOrder
from inflight.runner.worker import Worker
from inflight.sampling.row import SamplingRow


@pytest.fixture(scope="module")
def worker(tiny_dir):
    return Worker(str(tiny_dir), ExecutorConfig(
        dtype="float32", device="cpu", max_batch_size=4, max_num_tokens=64,
        kv_cache_config=KvCacheConfig(max_tokens=256, tokens_per_block=16)))


def _batch():
    """A prefill row that is sampled, and a prefill chunk that is not (more prompt follows)."""
    a = Sequence(request_id=1, prompt_token_ids=[5, 6, 7, 8, 9], max_new_tokens=4, block_table=[3])
    b = Sequence(request_id=2, prompt_token_ids=list(range(20, 40)), max_new_tokens=4,
                 block_table=[7, 2])
    return SchedulerOutput([ScheduledSequence(a, 5), ScheduledSequence(b, 12)]), a


def test_prepare_run_sample_is_launch(worker):
    batch, a = _batch()
    rows = [SamplingRow(token_ids=a.token_ids, num_prompt_tokens=5)]
    step = worker.prepare_inputs(StepOrder.from_batch(batch, worker.block_size, rows))
    assert step.input_ids.tolist() == [5, 6, 7, 8, 9] + list(range(20, 32))
    assert step.positions.tolist() == list(range(5)) + list(range(12))
    assert step.logits_indices.tolist() == [4] and step.num_sampled == 1
    assert step.metadata.query_start_loc_host == (0, 5, 17)
    logits, prompt_logits = worker.run_model(step)
    assert logits.shape == (1, worker.model_config.vocab_size) and logits.dtype == torch.float32
    assert prompt_logits is None
    token = worker.sample(logits, step).result().token_ids
    batch, a = _batch()  # the same step again on a fresh batch: same cache slots, same math
    rows = [SamplingRow(token_ids=a.token_ids, num_prompt_tokens=5)]
    assert worker.launch(StepOrder.from_batch(batch, worker.block_size, rows)).result().token_ids == token
    assert token == [int(logits.argmax())]


def test_rows_must_match_the_sampled_sequences(worker):
    batch, _ = _batch()
    with pytest.raises(ValueError, match="0 sampling rows for 1 sampled sequences"):
        StepOrder.from_batch(batch, worker.block_size, [])


def test_warm_up_runs_the_largest_step_without_touching_the_cache(worker):
    for cache in worker.kv_caches:
        cache.fill_(0.5)
    worker.warm_up(max_batch_size=4, max_num_tokens=64)
    assert all(bool((cache == 0.5).all()) for cache in worker.kv_caches)
    for cache in worker.kv_caches:
        cache.zero_()
    worker.warm_up(max_batch_size=8, max_num_tokens=3)  # fewer tokens than rows: one per row

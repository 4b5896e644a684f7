"""Tensor parallelism on the CPU: two gloo ranks against one, on tiny random checkpoints.

The tp=2 engine is the real thing: rank 0 is this process (scheduler, sampler), rank 1 a
spawned process that loads its shards with safetensors' get_slice and follows rank 0's step
messages. Greedy tokens must equal tp=1's; the chosen tokens' log probs may differ only by
fp32 summation order (the all-reduces add the ranks' partial sums in another order), bounded
by `tolerances.fp32_noise_bound`.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

if not torch.cuda.is_available():  # the CUDA-path test runs the Triton backend interpreted;
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (transformers does)

import transformers  # noqa: E402

from ensemble.errors import ConfigError  # noqa: E402
from inflight.api.config import ExecutorConfig, KvCacheConfig, ParallelConfig  # noqa: E402
from inflight.distributed.step_plan import StepPlan  # noqa: E402
from inflight.engine.llm_engine import LLMEngine  # noqa: E402
from inflight.fatal_errors import EngineFatalError  # noqa: E402
from inflight.model.config import ModelConfig  # noqa: E402
from inflight.model.sharding import Shard, check_divisible, shard_for  # noqa: E402
from inflight.distributed.group import check_devices  # noqa: E402
from tools.checkpoints import TINY_COMMON  # noqa: E402
from tests.model.engine_utils import assert_kv_idle, final, gen_request, output_tokens, run  # noqa: E402
from tests.model.tolerances import fp32_noise_bound  # noqa: E402

KV = KvCacheConfig(max_tokens=2048, tokens_per_block=8)
PROMPTS = [[5, 17, 42, 99, 7, 310], [1, 2, 3], list(range(20, 61)), [450, 8]]
MAX_TOKENS = [12, 9, 14, 6]


def _engine(path, tp: int, **config) -> LLMEngine:
    config = {**dict(dtype="float32", device="cpu", kv_cache_config=KV, max_batch_size=8, max_num_tokens=64,
                     enable_chunked_context=True), **config}
    return LLMEngine.from_dir(path, ExecutorConfig(parallel_config=ParallelConfig(tp), **config))


def _generate(engine: LLMEngine):
    requests = [gen_request(p, n, return_log_probs=True, streaming=i % 2 == 0)
                for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]
    responses = run(engine, requests)
    tokens = [output_tokens(r) for r in responses]
    log_probs = [[lp for resp in r for lp in resp.result.log_probs[0]] for r in responses]
    return tokens, log_probs


def _tiny_llama(path) -> None:
    """One checkpoint that exercises every sharding rule: q/k/v, o_proj and MLP biases (the
    row-parallel biases are added once), tied embeddings, and a vocabulary of 501 (the last
    vocabulary shard is padded)."""
    cfg = transformers.LlamaConfig(**{**TINY_COMMON, "vocab_size": 501}, attention_bias=True,
                                   mlp_bias=True, tie_word_embeddings=True)
    torch.manual_seed(99)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits biases to 0: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-llama")
    _tiny_llama(path)
    return path


@pytest.mark.timeout(240)
def test_tp2_matches_tp1(checkpoint, monkeypatch):
    monkeypatch.setenv("INFLIGHT_TP_TIMEOUT_S", "60")  # a collective that never pairs up fails
    tmp_path = checkpoint
    config = ModelConfig.from_dir(tmp_path)
    want_tokens, want_lp = _generate(_engine(tmp_path, 1))
    engine = _engine(tmp_path, 2)
    try:
        assert engine.worker.tp.size == 2 and engine.worker.shard_config.num_key_value_heads == 1
        got_tokens, got_lp = _generate(engine)
        assert got_tokens == want_tokens
        # Log probs are of the order of log(vocab); the bound is fp32 noise over the depth.
        bound = fp32_noise_bound(config.num_hidden_layers, config.hidden_size, 10.0)
        for got, want in zip(got_lp, want_lp):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0.0, atol=bound)
        # A bad step on rank 0 (a logits hook raising) fails its request; the ranks stay paired.
        def bad_hook(request_id, token_ids, logits):
            raise ValueError("boom")
        bad, good = run(engine, [gen_request(PROMPTS[0], 4, logits_processor=bad_hook),
                                 gen_request(PROMPTS[1], MAX_TOKENS[1])])
        assert "boom" in final(bad).error_msg
        assert_kv_idle(engine)
        assert _generate(engine)[0] == want_tokens
        # A rank that fails (here: a message it cannot read) exits at once, and the engine stops
        # at its next step instead of waiting on the rank (no hang, no half-served steps).
        rank1 = engine.worker.ranks.processes[0]
        engine.worker.tp.send_message(99)
        rank1.join(timeout=120)
        # The launcher's watcher thread joins the rank too; whichever reaps it first sets the
        # exit code, so the other may see it a moment later.
        deadline = time.monotonic() + 10
        while rank1.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rank1.exitcode == 1
        engine.add_request(gen_request(PROMPTS[0], 4))
        with pytest.raises(EngineFatalError, match="tensor-parallel rank is gone"):
            engine.step()
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.worker.ranks.processes)


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.is_available(), reason="bench/gpu_tp.py runs these paths on GPUs")
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
def test_tp2_with_the_cuda_start_up_and_step_paths(checkpoint, monkeypatch, tmp_path):
    """The protocol of a CUDA run, on gloo: every rank runs the warm-up, the graph runner's
    buckets, precompile, overlapped steps (sampled ids broadcast) and decode steps from the
    runner's static buffers (`tests.model.tp_cuda_like`). Every collective pairs up across the
    ranks (same order, sizes, dtypes), greedy tokens equal tp=1's, and the stop is clean: the
    teardown is collective (as NCCL's is), so a rank 0 that waited for rank 1's exit before
    its own teardown (the first 2-GPU run's hang) deadlocks here too and rank 1 is killed.
    Small batch and lengths: the attention kernels run under Triton's interpreter."""
    from inflight.runner import ranks as launch
    from tests.model import tp_cuda_like
    path = checkpoint
    prompts, max_tokens = [[5, 17, 42, 99, 7, 310], [1, 2, 3], [450, 8]], [5, 4, 6]
    config = dict(max_batch_size=4, max_num_tokens=16, max_seq_len=32)

    def requests():  # + a row whose logits hook fails on rank 0 (sampling is rank 0's alone):
        # it makes the steps synchronous while it lives; the sampled ids are still broadcast
        return [gen_request(p, n) for p, n in zip(prompts, max_tokens)] + [
            gen_request([9, 10, 11], 3, logits_processor=_failing_hook)]

    want = run(_engine(path, 1, **config), requests())
    monkeypatch.setenv("INFLIGHT_TP_TIMEOUT_S", "60")
    monkeypatch.setenv(tp_cuda_like.TRACE_ENV, str(tmp_path))
    tp_cuda_like.apply(monkeypatch.setattr)
    monkeypatch.setattr(launch, "_rank_main", tp_cuda_like.rank_main)
    monkeypatch.setattr(tp_cuda_like, "TRACE", [])
    engine = _engine(path, 2, enable_overlap_scheduler=True, **config)
    try:
        worker = engine.worker
        assert worker.overlap and worker.graph_runner is not None and worker.backend.name == "triton"
        assert worker.graph_runner.mixed is not None  # mixed steps from static buffers too
        got = run(engine, requests())
    finally:
        start = time.monotonic()
        engine.close()
        stop_s = time.monotonic() - start
    assert [output_tokens(r) for r in got[:3]] == [output_tokens(r) for r in want[:3]]
    assert "boom" in final(got[3]).error_msg
    rank1 = engine.worker.ranks.processes[0]
    assert rank1.exitcode == 0, f"rank 1 did not stop cleanly (exit code {rank1.exitcode})"
    assert stop_s < launch._STOP_TIMEOUT_S, f"stopping the ranks took {stop_s:.1f} s"
    rank0_trace = tp_cuda_like.TRACE
    rank1_trace = json.loads((tmp_path / "rank1.json").read_text())
    kinds = {entry[0] for entry in rank0_trace}
    assert {"all_reduce", "all_gather", "broadcast", "min", "message", "close"} <= kinds
    for i, (mine, theirs) in enumerate(zip(rank0_trace, rank1_trace)):
        assert mine == theirs, f"collective {i}: rank 0 {mine}, rank 1 {theirs}"
    assert len(rank0_trace) == len(rank1_trace)


def _failing_hook(request_id, token_ids, logits):
    raise ValueError("boom")


def test_sharding_rules():
    assert shard_for("model.layers.0.self_attn.q_proj.weight", (8, 4), 1, 2) == Shard(0, 4, 4)
    assert shard_for("model.layers.0.mlp.up_proj.bias", (6,), 0, 2) == Shard(0, 0, 3)
    assert shard_for("model.layers.0.mlp.down_proj.weight", (4, 6), 1, 2) == Shard(1, 3, 3)
    assert shard_for("model.layers.0.self_attn.o_proj.bias", (4,), 1, 2).zeros_off_leader
    assert shard_for("lm_head.weight", (501, 4), 1, 2) == Shard(0, 251, 250, pad_to=251)
    assert shard_for("model.norm.weight", (4,), 1, 2) is None
    assert shard_for("model.layers.0.self_attn.q_proj.weight", (8, 4), 0, 1) is None


def test_heads_that_do_not_divide_are_refused():
    config = ModelConfig.from_hf_dict({**TINY_COMMON, "architectures": ["LlamaForCausalLM"]})
    check_divisible(config, 2)
    with pytest.raises(ConfigError,
                       match="tensor_parallel_size 4 does not divide the model's 2 key/value heads"):
        check_divisible(config, 4)


def test_missing_gpus_are_refused():
    config = ExecutorConfig(device="cuda", parallel_config=ParallelConfig(2, (0, 7)))
    if torch.cuda.device_count() >= 8:
        pytest.skip("this machine has 8 GPUs")
    with pytest.raises(ConfigError, match=r"GPUs 0,7 \(gpu_device_ids\) but this process sees"):
        check_devices(config)
    with pytest.raises(ConfigError, match="lists 1 GPUs"):
        ParallelConfig(2, (0,))


def test_step_plan_round_trip():
    plan = StepPlan(starts=[0, 40, 7], tokens=[[5, 6, 7], [-2], [9]], sampled=[True, True, False],
                    block_tables=[[3], [1, 4, 8, 2, 6, 11], [0]], block_size=8)
    assert StepPlan.unpack(plan.pack()) == plan
    # Rank 0 holds the sequences' whole tables; only the blocks the step reads are sent.
    longer = StepPlan(plan.starts, plan.tokens, plan.sampled, [[3, 9], [1, 4, 8, 2, 6, 11, 5], [0, 1]], 8)
    assert StepPlan.unpack(longer.pack()) == plan
    assert StepPlan.unpack(StepPlan([], [], [], [], 8).pack()).num_rows == 0
    # A row verifying draft tokens: its count rides in the sampled column (1 + k).
    drafts = StepPlan([0, 40], [[5, 6, 7], [4, 9, 9]], [True, True], [[3], [1, 4, 8, 2, 6, 11]], 8,
                      num_drafts=[0, 2])
    assert StepPlan.unpack(drafts.pack()) == drafts


@pytest.mark.timeout(240)
def test_tp2_with_lora_adapters_matches_tp1(checkpoint, monkeypatch):
    """Two adapters (all seven projections; q/v/down only) and the base model in one batch:
    rank 0 sends each adapter to rank 1 before the first step that loads it (once, though two rows
    of that step use it), every rank keeps its
    shard (B's rows for column-parallel projections, A's columns for row-parallel ones), and the
    tokens equal tp=1's. A second round sends the ids alone: the ranks' stores already hold them."""
    from inflight.api.config import PeftCacheConfig
    from inflight.api.types import LoraConfig
    from inflight.lora.nvidia import to_nvidia
    from tools.checkpoints import random_lora_adapter

    monkeypatch.setenv("INFLIGHT_TP_TIMEOUT_S", "60")
    config = ModelConfig.from_dir(checkpoint)
    rows = [to_nvidia(random_lora_adapter(config, 4, 5), "float32"),
            to_nvidia(random_lora_adapter(config, 8, 6, ["q_proj", "v_proj", "down_proj"]), "float32")]
    tasks = [1, None, 2, 1]

    def generate(engine, with_weights):
        requests, sent = [], set()
        for prompt, n, task in zip(PROMPTS, MAX_TOKENS, tasks):
            request = gen_request(prompt, n)
            if task is not None:  # the weights with the id's first request only: later rows share them
                first = with_weights and task not in sent
                request.lora_config = LoraConfig(task, *rows[task - 1]) if first else LoraConfig(task)
                sent.add(task)
            requests.append(request)
        return [output_tokens(r) for r in run(engine, requests)]

    peft = PeftCacheConfig(max_loras=2, max_adapter_size=8)
    want = generate(_engine(checkpoint, 1, peft_cache_config=peft), True)
    engine = _engine(checkpoint, 2, peft_cache_config=peft)
    try:
        assert generate(engine, True) == want
        assert generate(engine, False) == want
    finally:
        engine.close()


@pytest.mark.timeout(240)
def test_tp2_verifies_drafts_as_tp1(checkpoint, monkeypatch):
    """Speculative decoding at tp=2: the step plan carries each row's draft count, so the other
    rank computes the same positions' logits (the vocabulary-parallel LM head gathers them). A
    request's own draft (the tp=1 run's tokens, always right) and the n-gram drafter give tp=1's
    greedy tokens, and the accepted counts match."""
    from inflight.api.config import NgramConfig, SpeculativeConfig
    from inflight.api.types import ExternalDraftTokensConfig

    monkeypatch.setenv("INFLIGHT_TP_TIMEOUT_S", "60")
    spec = SpeculativeConfig(ngram=NgramConfig(max_draft_tokens=3, min_ngram=1))
    want = [output_tokens(r) for r in run(_engine(checkpoint, 1), [gen_request(p, n)
                                                                   for p, n in zip(PROMPTS, MAX_TOKENS)])]
    engine = _engine(checkpoint, 2, speculative_config=spec)
    try:
        requests = [gen_request(p, n, external_draft_tokens_config=ExternalDraftTokensConfig(w[:4]))
                    for p, n, w in zip(PROMPTS, MAX_TOKENS, want)]
        for request in requests:
            request.output_config.return_perf_metrics = True
        results = run(engine, requests)
        assert [output_tokens(r) for r in results] == want
        assert all(r[-1].result.request_perf_metrics.total_accepted_draft_tokens >= 4 for r in results)
    finally:
        engine.close()

"""Engine vs Hugging Face transformers (fp32, CPU), and the offline `ModelRunner` API.

Greedy tokens through the whole engine (scheduler, paged KV cache, sampler), with several prompts
submitted together so they share steps, must equal HF `generate(do_sample=False)` token for token:
for the real SmolLM2-135M-Instruct (a chat-template prompt and plain prompts) and for tiny random
Llama (llama3 RoPE scaling), Qwen2 and Mistral checkpoints.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from inflight.executor.config import KvCacheConfig
from inflight.executor.types import FinishReason, RequestError
from inflight.runtime import LogitsProcessor, ModelRunner, StoppingCriteria
from tests.model.checkpoints import TINY_KINDS, save_tiny_checkpoint
from tests.model.engine_utils import (assert_kv_idle, final, gen_request, hf_greedy, make_engine,
                                     output_tokens, run)

NUM_NEW = 24
EOS = 2  # SmolLM2's <|im_end|> (its only eos id)
PLAIN_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land far away,"]



@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return transformers.AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def runner(smol, tokenizer):
    return ModelRunner(make_engine(smol), tokenizer)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    return [tokenizer.encode(text, add_special_tokens=False) for text in [chat, *PLAIN_PROMPTS]]


@pytest.fixture(scope="module")
def hf_refs(smollm2_dir, prompts) -> list[list[int]]:
    """HF greedy continuations of `prompts`, eos disabled."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, NUM_NEW) for p in prompts]


def test_smollm2_greedy_matches_hf(smol, hf_refs, prompts):
    engine = make_engine(smol)
    # end_id=-1: no end token, so every request runs NUM_NEW steps like HF with eos disabled.
    results = run(engine, [gen_request(p, NUM_NEW, end_id=-1) for p in prompts])
    assert engine.iteration == NUM_NEW  # all prompts prefilled in step 1, then decoded together
    for ref, responses in zip(hf_refs, results):
        assert output_tokens(responses) == ref
        assert final(responses).result.finish_reasons == [FinishReason.LENGTH]


def test_smollm2_stops_at_eos_like_hf(runner, hf_refs, prompts):
    # ModelRunner defaults end_id to the model's eos. HF greedy with eos stops right after the
    # first eos of the eos-free continuation; our outputs exclude the end token.
    outputs = runner.generate(prompts, max_new_tokens=NUM_NEW)
    assert outputs[0].finish_reason is FinishReason.END_ID
    assert outputs[0].text == "The capital of France is Paris."
    for prompt, ref, out in zip(prompts, hf_refs, outputs):
        if EOS in ref:
            assert out.finish_reason is FinishReason.END_ID
            assert out.output_token_ids == ref[:ref.index(EOS)]
        else:
            assert out.finish_reason is FinishReason.LENGTH and out.output_token_ids == ref
        assert out.prompt_token_ids == prompt
    assert not runner.engine.has_unfinished()


@pytest.fixture(scope="module", params=TINY_KINDS)
def tiny(request, tmp_path_factory):
    """(hf_model, checkpoint dir) for one tiny random architecture."""
    path = tmp_path_factory.mktemp(request.param)
    return save_tiny_checkpoint(request.param, path), path


TINY_PROMPTS = [[1, 17, 250, 33, 499, 8, 120, 64, 3], [1, 5], list(range(3, 34)), [7, 300, 301, 7, 300]]


@pytest.mark.parametrize("paging", ["default", "chunked_small_blocks"])
def test_tiny_greedy_matches_hf(tiny, paging):
    hf, path = tiny
    config = {}
    if paging == "chunked_small_blocks":  # prompts computed in chunks of <= 10 tokens
        config = dict(max_num_tokens=10, enable_chunked_context=True,
                      kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=4))
    results = run(make_engine(path, **config), [gen_request(p, NUM_NEW) for p in TINY_PROMPTS])
    for prompt, responses in zip(TINY_PROMPTS, results):
        assert output_tokens(responses) == hf_greedy(hf, prompt, NUM_NEW)


# ----- offline API: StoppingCriteria and LogitsProcessor -------------------------------------

class StopOnToken(StoppingCriteria):
    def __init__(self, token_id: int):
        self.token_id = token_id
        self.calls: list[tuple[int, list[int]]] = []

    def __call__(self, request_id: int, token_ids: list[int]) -> bool:
        self.calls.append((request_id, list(token_ids)))
        return token_ids[-1] == self.token_id


class BanTokens(LogitsProcessor):
    def __init__(self, banned: set[int]):
        self.banned = sorted(banned)
        self.request_ids: set[int] = set()

    def __call__(self, request_id: int, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.request_ids.add(request_id)
        logits = logits.clone()
        logits[self.banned] = float("-inf")
        return logits


def test_runner_stopping_criteria(runner, prompts):
    plain = runner.generate(prompts[1:], max_new_tokens=16, end_id=-1)
    stop_token = plain[0].output_token_ids[3]
    criteria = StopOnToken(stop_token)
    outputs = runner.generate(prompts[1:], max_new_tokens=16, end_id=-1, stopping_criteria=criteria)
    for ref, out in zip(plain, outputs):
        if stop_token in ref.output_token_ids:  # stops right after it, keeping it
            cut = ref.output_token_ids.index(stop_token) + 1
            assert out.output_token_ids == ref.output_token_ids[:cut]
            assert out.finish_reason is FinishReason.STOP_WORDS
        else:
            assert out.output_token_ids == ref.output_token_ids
            assert out.finish_reason is FinishReason.LENGTH
    # Called once per generated token with the whole sequence (prompt first).
    assert len(criteria.calls) == sum(len(o.output_token_ids) for o in outputs)
    _, token_ids = criteria.calls[0]
    assert token_ids[:-1] in prompts[1:]


class RaiseOnCall(StoppingCriteria):
    def __call__(self, request_id: int, token_ids: list[int]) -> bool:
        raise ValueError("broken criteria")


def test_a_raising_stopping_criteria_fails_only_its_request(runner, prompts):
    with pytest.raises(RuntimeError, match="stopping criteria failed: broken criteria"):
        runner.generate(prompts[1:2], max_new_tokens=4, end_id=-1, stopping_criteria=RaiseOnCall())
    assert runner.engine.block_manager.num_free_blocks == runner.engine.block_manager.num_total_blocks
    assert runner.generate(prompts[1:2], max_new_tokens=4, end_id=-1)[0].output_token_ids


def test_runner_logits_processor(runner, prompts):
    plain = runner.generate(prompts[1:3], max_new_tokens=12, end_id=-1)
    banned = {t for out in plain for t in out.output_token_ids}
    processor = BanTokens(banned)
    outputs = runner.generate(prompts[1:3], max_new_tokens=12, end_id=-1, logits_processor=processor,
                              return_log_probs=True)
    for out in outputs:
        assert len(out.output_token_ids) == 12 and not banned & set(out.output_token_ids)
        assert len(out.log_probs) == 12 and all(lp <= 0.0 for lp in out.log_probs)
        assert out.text == runner.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)
    assert len(processor.request_ids) == 2


def test_runner_leaves_no_request_behind_on_errors(smol, runner, prompts):
    too_long = list(range(10, 10 + runner.engine.worker.max_seq_len))
    with pytest.raises(RequestError, match="exceeds the model's maximum sequence length"):
        runner.generate([prompts[1], too_long], max_new_tokens=4)
    assert_kv_idle(runner.engine)
    # A failed step fails its request; the call raises and cancels the ones still queued.
    one_at_a_time = ModelRunner(make_engine(smol, max_batch_size=1))

    def fail_second_step(batch):
        if one_at_a_time.engine.iteration == 1:
            raise RuntimeError("injected")

    one_at_a_time.engine.fault_hook = fail_second_step
    with pytest.raises(RuntimeError, match="engine step failed: RuntimeError: injected"):
        one_at_a_time.generate(prompts[1:], max_new_tokens=4)
    assert_kv_idle(one_at_a_time.engine)
    one_at_a_time.engine.fault_hook = None
    assert len(one_at_a_time.generate(prompts[1:2], max_new_tokens=4)[0].output_token_ids) == 4
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        ModelRunner(runner.engine).generate(["hello"])
    with pytest.raises(TypeError, match="unknown ExecutorConfig fields"):
        ModelRunner.from_dir("unused-dir", max_batch=3)


"""Engine vs Hugging Face transformers (fp32, CPU), and the offline `ModelRunner` API.

Greedy tokens through the whole engine (scheduler, paged KV cache, sampler), with several prompts
submitted together so they share steps, must equal HF `generate(do_sample=False)` token for token
(a divergence is allowed only where HF's own top-2 margin is within fp32 noise, see
tests/model/numerics.py): for the real SmolLM2-135M-Instruct (a chat-template prompt and plain
prompts) and for tiny random Llama (llama3 RoPE scaling), Qwen2 and Mistral checkpoints.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from inflight.api.config import KvCacheConfig
from inflight.api.types import FinishReason
from inflight.hosts.runtime import ModelRunner
from tools.checkpoints import TINY_KINDS, save_tiny_checkpoint
from tests.model.engine_utils import final, gen_request, hf_greedy, make_engine, output_tokens, run
from tests.model.numerics import assert_greedy_tokens_match

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
def hf_refs(smollm2_hf, prompts) -> list[tuple[list[int], list[torch.Tensor]]]:
    """HF greedy continuations of `prompts` (eos disabled) with their logits."""
    return [hf_greedy(smollm2_hf, p, NUM_NEW) for p in prompts]


def test_smollm2_greedy_matches_hf(smol, hf_refs, prompts):
    engine = make_engine(smol)
    # end_id=-1: no end token, so every request runs NUM_NEW steps like HF with eos disabled.
    results = run(engine, [gen_request(p, NUM_NEW, end_id=-1) for p in prompts])
    assert engine.iteration == NUM_NEW  # all prompts prefilled in step 1, then decoded together
    for index, ((ref, ref_logits), responses) in enumerate(zip(hf_refs, results)):
        assert_greedy_tokens_match(ref, ref_logits, output_tokens(responses), engine.model_config,
                                   f"prompt {index}")
        assert final(responses).result.finish_reasons == [FinishReason.LENGTH]


def test_smollm2_stops_at_eos_like_hf(runner, hf_refs, prompts):
    # ModelRunner defaults end_id to the model's eos. HF greedy with eos stops right after the
    # first eos of the eos-free continuation; our outputs exclude the end token.
    outputs = runner.generate(prompts, max_new_tokens=NUM_NEW)
    assert outputs[0].finish_reason is FinishReason.END_ID
    assert outputs[0].text == "The capital of France is Paris."
    for index, (prompt, (ref, ref_logits), out) in enumerate(zip(prompts, hf_refs, outputs)):
        ended = out.finish_reason is FinishReason.END_ID
        got = out.output_token_ids + ([EOS] if ended else [])  # outputs exclude the end token
        num_same = assert_greedy_tokens_match(ref[:len(got)], ref_logits, got, runner.engine.model_config,
                                              f"prompt {index}")
        if num_same == len(got):  # the same tokens: then it ends where HF's first eos is
            assert ended == (EOS in ref)
            assert len(got) == (ref.index(EOS) + 1 if ended else NUM_NEW)
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
    engine = make_engine(path, **config)
    results = run(engine, [gen_request(p, NUM_NEW) for p in TINY_PROMPTS])
    for index, (prompt, responses) in enumerate(zip(TINY_PROMPTS, results)):
        ref, ref_logits = hf_greedy(hf, prompt, NUM_NEW)
        assert_greedy_tokens_match(ref, ref_logits, output_tokens(responses), engine.model_config,
                                   f"prompt {index}")

"""Paged-cache model vs Hugging Face transformers, in fp32 on the CPU.

Tiny random checkpoints (Llama with llama3 RoPE scaling and biases, Qwen2 with tied embeddings
and q/k/v biases, Mistral with an explicit head_dim) plus the real SmolLM2-135M are driven
through the paged KV cache with scattered block tables, one-shot and chunked prefill, and
mixed batches. Greedy tokens must equal HF `generate` (except past a near tie), and logits must
match HF's, and a row's logits must not depend on its batch neighbours, up to the fp32 rounding
bound of `tests/model/numerics.py` (derived from depth, widths and logit magnitude, not tuned).
"""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import inflight.runner.worker
from inflight.model.attention import StepMetadata
from inflight.model.config import ModelConfig
from inflight.model.loader import allocate_kv_caches, load_model
from inflight.model.rotary import compute_inv_freq
from inflight.platform import resolve_dtype
from tools.checkpoints import LLAMA3_ROPE, TINY_COMMON, TINY_KINDS, tiny_hf_model
from tests.model.engine_utils import hf_greedy
from tests.model.numerics import assert_greedy_tokens_match, assert_logits_close

BLOCK_SIZE = 4
NUM_BLOCKS = 96


@pytest.fixture(scope="module", params=TINY_KINDS)
def tiny(request, tmp_path_factory):
    """(hf_model, our_model, config) for one tiny architecture."""
    hf = tiny_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, config = load_model(path, torch.float32, "cpu")
    return hf, model, config


@pytest.fixture(scope="module")
def smollm2(smol, smollm2_hf):
    model, config = inflight.runner.worker.load_model(smol, torch.float32, torch.device("cpu"))  # shared copy
    return smollm2_hf, model, config


def scattered_table(num_blocks: int, seed: int, exclude: set[int] = frozenset()) -> list[int]:
    """A non-contiguous, shuffled block table."""
    ids = [b for b in range(NUM_BLOCKS) if b not in exclude]
    random.Random(seed).shuffle(ids)
    return ids[:num_blocks]


class PagedRunner:
    """Minimal driver: one KV cache, steps of (new_tokens, start_position, block_table) rows."""

    def __init__(self, model, config):
        self.model = model
        self.caches = allocate_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")

    def step(self, rows, all_logits: bool = False) -> torch.Tensor:
        meta = StepMetadata.build([(start, len(toks), table) for toks, start, table in rows],
                                  BLOCK_SIZE, "cpu")
        input_ids = torch.tensor([t for toks, _, _ in rows for t in toks])
        attn = self.model.attention_backend.build_metadata(meta)
        hidden = self.model(input_ids, meta.positions, self.caches, attn)
        if not all_logits:
            hidden = hidden[meta.last_token_indices]
        return self.model.compute_logits(hidden)


def paged_greedy(model, config, prompt, max_new, chunk=None, seed=0):
    """Greedy decode through the paged cache; returns (tokens, [logits per generated token])."""
    runner = PagedRunner(model, config)
    table = scattered_table(-(-(len(prompt) + max_new) // BLOCK_SIZE), seed)
    chunk = chunk or len(prompt)
    pos = 0
    while pos < len(prompt):
        logits = runner.step([(prompt[pos:pos + chunk], pos, table)])[0]
        pos += len(prompt[pos:pos + chunk])
    tokens, step_logits = [], []
    for i in range(max_new):
        step_logits.append(logits)
        tokens.append(int(logits.argmax()))
        if i + 1 < max_new:
            logits = runner.step([([tokens[-1]], pos, table)])[0]
            pos += 1
    return tokens, step_logits


def assert_greedy_parity(hf, model, config, prompt, max_new, chunk=None):
    ref_tokens, ref_logits = hf_greedy(hf, prompt, max_new)
    tokens, logits = paged_greedy(model, config, prompt, max_new, chunk=chunk)
    num_same = assert_greedy_tokens_match(ref_tokens, ref_logits, tokens, config)
    # Logits are comparable while both ran on the same tokens (up to and including a near tie).
    for step in range(min(num_same + 1, max_new)):
        assert_logits_close(logits[step], ref_logits[step], config, f"step {step}")


def test_tiny_greedy_matches_hf(tiny):
    hf, model, config = tiny
    prompt = [1, 17, 250, 33, 499, 8, 120, 64, 3]
    assert_greedy_parity(hf, model, config, prompt, max_new=20)


def test_tiny_chunked_prefill_matches_hf(tiny):
    hf, model, config = tiny
    prompt = list(range(3, 26))  # 23 tokens: chunks of 5 straddle the 4-token blocks
    assert_greedy_parity(hf, model, config, prompt, max_new=8, chunk=5)


def test_tiny_prefill_logits_all_positions(tiny):
    hf, model, config = tiny
    prompt = [5, 9, 300, 2, 77, 41, 12, 200, 13, 14, 15]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    ours = PagedRunner(model, config).step([(prompt, 0, scattered_table(3, 1))], all_logits=True)
    assert_logits_close(ours, ref, config, "prefill")


def test_smollm2_greedy_matches_hf(smollm2):
    hf, model, config = smollm2
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198,
              23021, 260, 3458, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    assert_greedy_parity(hf, model, config, prompt, max_new=20)


def test_smollm2_chunked_prefill_matches_hf(smollm2):
    hf, model, config = smollm2
    prompt = [1, 504, 3458, 282, 4649, 314, 1180, 30, 378, 3458, 282, 6974, 314, 253]
    assert_greedy_parity(hf, model, config, prompt, max_new=6, chunk=6)


def _mixed_batch_check(model, config):
    """A decode row, a fresh prefill row and a second-chunk row in one step equal each alone."""
    prompt_a, decode_tok = [5, 6, 7, 8, 9, 10, 11], 12
    prompt_b = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    prompt_c = [40, 41, 42, 43, 44, 45, 46, 47, 48]  # chunk 1: 5 tokens, chunk 2: 4 tokens
    table_a = scattered_table(4, 11)
    table_b = scattered_table(4, 12, exclude=set(table_a))
    table_c = scattered_table(4, 13, exclude=set(table_a) | set(table_b))

    alone = []
    runner = PagedRunner(model, config)
    runner.step([(prompt_a, 0, table_a)])
    alone.append(runner.step([([decode_tok], len(prompt_a), table_a)])[0])
    alone.append(PagedRunner(model, config).step([(prompt_b, 0, table_b)])[0])
    runner = PagedRunner(model, config)
    runner.step([(prompt_c[:5], 0, table_c)])
    alone.append(runner.step([(prompt_c[5:], 5, table_c)])[0])

    runner = PagedRunner(model, config)
    runner.step([(prompt_a, 0, table_a), (prompt_c[:5], 0, table_c)])
    batched = runner.step([([decode_tok], len(prompt_a), table_a), (prompt_b, 0, table_b),
                           (prompt_c[5:], 5, table_c)])
    for row, ref in enumerate(alone):
        assert_logits_close(batched[row], ref, config, f"row {row}")


def test_tiny_mixed_batch_rows_independent(tiny):
    _, model, config = tiny
    _mixed_batch_check(model, config)


def test_smollm2_mixed_batch_rows_independent(smollm2):
    _, model, config = smollm2
    _mixed_batch_check(model, config)


def test_decode_batch_with_different_lengths(smollm2):
    _, model, config = smollm2
    prompts = [[1, 2, 3], list(range(100, 118)), list(range(300, 309))]
    tables: list[list[int]] = []
    for i in range(3):
        tables.append(scattered_table(6, 20 + i, exclude={b for t in tables for b in t}))
    runner = PagedRunner(model, config)
    runner.step([(p, 0, t) for p, t in zip(prompts, tables)])
    batched = runner.step([([7], len(p), t) for p, t in zip(prompts, tables)])
    for row, (p, t) in enumerate(zip(prompts, tables)):
        alone = PagedRunner(model, config)
        alone.step([(p, 0, t)])
        ref = alone.step([([7], len(p), t)])[0]
        assert_logits_close(batched[row], ref, config, f"row {row}")


def test_llama3_inv_freq_matches_hf():
    cfg = transformers.LlamaConfig(**TINY_COMMON, rope_parameters=dict(LLAMA3_ROPE))
    ref, _ = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](cfg)
    ours = compute_inv_freq(16, 10000.0, {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"})
    assert torch.equal(ours, ref)


def test_config_normalisation():
    base = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=64,
                intermediate_size=8, num_hidden_layers=2, num_attention_heads=4)
    legacy = ModelConfig.from_hf_dict({**base, "rope_theta": 5e5, "rope_scaling": {
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "eos_token_id": [7, 8]})
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling["rope_type"] == "llama3"
    assert legacy.head_dim == 16 and legacy.num_key_value_heads == 4
    assert legacy.eos_token_ids == [7, 8]
    v5 = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "linear",
                                   "rope_theta": 1e4, "factor": 2.0}, "rope_scaling": None})
    assert v5.rope_scaling == {"rope_type": "linear", "factor": 2.0} and v5.rope_theta == 1e4
    plain = ModelConfig.from_hf_dict({**base, "rope_parameters": {"rope_type": "default",
                                      "rope_theta": 1e5}}, {"eos_token_id": [2, 9]})
    assert plain.rope_scaling is None and plain.rope_theta == 1e5
    qwen = ModelConfig.from_hf_dict({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.attention_bias and not qwen.o_proj_bias
    assert qwen.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 4 * 16 * 2
    with pytest.raises(ValueError, match="LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf_dict({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_dict({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_smollm2_config(smollm2_dir):
    config = ModelConfig.from_dir(smollm2_dir)
    assert config.tie_word_embeddings and config.num_key_value_heads == 3
    assert config.eos_token_ids == [2] and config.rope_scaling is None
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", "cpu")


def test_loader_reads_sharded_checkpoint(tmp_path):
    hf = tiny_hf_model("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model, config = load_model(tmp_path, torch.float32, "cpu")
    ours = dict(model.named_parameters(remove_duplicate=False))
    for name, ref in hf.state_dict().items():
        assert torch.equal(ours[name], ref), name
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_loader_rejects_missing_and_unexpected(tmp_path):
    hf = tiny_hf_model("mistral")
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not use: model.layers.0.self_attn.extra.weight"):
        load_model(tmp_path, torch.float32, "cpu")
    del weights["model.layers.0.self_attn.extra.weight"], weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(tmp_path, torch.float32, "cpu")
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["MistralForCausalLM"]

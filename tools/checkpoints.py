"""Tiny random Hugging Face checkpoints shared by the model and engine tests and checks/gpu_parity.py.

Llama with llama3 RoPE scaling and attention/MLP biases, Qwen2 with tied embeddings and q/k/v
biases, Mistral with an explicit head_dim. `initializer_range` is large and biases/norms are
randomised so logits are well separated (greedy parity is not decided by float noise).
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY_KINDS = ("llama3", "qwen2", "mistral")
TINY_COMMON = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                   initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def tiny_hf_model(kind: str, seed: int = 1234) -> torch.nn.Module:
    """A deterministic (seeded) tiny random model of one architecture, in eval mode."""
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**TINY_COMMON, rope_parameters=dict(LLAMA3_ROPE),
                                       attention_bias=True, mlp_bias=True)
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**TINY_COMMON, tie_word_embeddings=True)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        cfg = transformers.MistralConfig(**TINY_COMMON, head_dim=32, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():  # HF inits biases to 0 and norms to 1; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.3)
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def save_tiny_checkpoint(kind: str, path: Path, seed: int = 1234) -> torch.nn.Module:
    """Writes `tiny_hf_model(kind, seed)` to `path` (a HF folder) and returns the HF model."""
    model = tiny_hf_model(kind, seed)
    model.save_pretrained(path)
    return model


def random_lora_adapter(config, rank: int, seed: int, modules=None, dtype: torch.dtype = torch.float32):
    """A random LoRA adapter (`inflight.lora.adapter.LoraAdapter`) for a model of `config` on
    every layer's `modules` (default all seven): A ~ N(0, 1/in), B ~ N(0, 1/rank), so a delta
    is of the order of its input, big enough to change greedy answers. Benchmarks and tests."""
    from inflight.lora.adapter import MODULES, LoraAdapter, module_shapes

    generator = torch.Generator().manual_seed(seed)
    shapes = module_shapes(config)
    weights = {}
    for layer in range(config.num_hidden_layers):
        for module in modules or MODULES:
            in_features, out_features = shapes[module]
            a = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            b = torch.randn(out_features, rank, generator=generator) / rank ** 0.5
            weights[(layer, module)] = (a.to(dtype), b.to(dtype))
    return LoraAdapter(weights)

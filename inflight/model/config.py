"""Model hyper-parameters read from a Hugging Face `config.json`.

`ModelConfig` is the single, normalised view of a checkpoint that the model, the loader and the
KV-cache sizing use. It hides the differences between transformers 4 (`rope_theta` +
`rope_scaling`) and transformers 5 (`rope_parameters`) and between the Llama-family
architectures (Qwen2 always has q/k/v biases but writes no `attention_bias` key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# Used when a config names no `architectures` (some hand-written configs only set model_type).
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _rope_type(d: dict[str, Any]) -> str:
    return str(d.get("rope_type") or d.get("type") or "default")


def _normalise_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Returns (rope_theta, rope_scaling) from either config generation.

    rope_scaling is None for plain RoPE, else a copy carrying `rope_type` (never the legacy
    `type` key) and the type's parameters, without `rope_theta`.
    """
    params = d.get("rope_parameters")
    # transformers 5 may write a per-layer-type dict ({"full_attention": {...}}); these
    # architectures use one rope for all layers, so take the first.
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    theta = None
    if isinstance(params, dict):
        theta = params.get("rope_theta")
    if theta is None:
        theta = d.get("rope_theta", 10000.0)
    scaling = None
    for source in (params, d.get("rope_scaling")):
        if isinstance(source, dict) and _rope_type(source) != "default":
            scaling = {k: v for k, v in source.items() if k not in ("rope_theta", "type")}
            scaling["rope_type"] = _rope_type(source)
            break
    if scaling is not None and scaling["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type '{scaling['rope_type']}'; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return float(theta), scaling


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; else {"rope_type": "linear"|"llama3", ...type parameters}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    # Bias on q/k/v projections (Qwen2: always) and on o_proj (Llama's attention_bias only).
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    torch_dtype: str | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # Stored for completeness; the attention backends attend over the full context.
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any],
                     generation_config: dict[str, Any] | None = None) -> "ModelConfig":
        """Builds the config from a parsed HF `config.json` (and optional generation config,
        whose eos ids are merged in: instruct models often list extra stop ids there)."""
        archs = d.get("architectures") or []
        arch = archs[0] if archs else _MODEL_TYPE_TO_ARCH.get(d.get("model_type", ""), "")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported model architecture '{arch or d.get('model_type')}'; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act '{act}'; only 'silu' is implemented")
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = d.get("head_dim") or hidden // heads
        theta, scaling = _normalise_rope(d)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        llama_bias = bool(d.get("attention_bias", False)) and arch == "LlamaForCausalLM"
        sliding = d.get("sliding_window")
        if is_qwen2 and not d.get("use_sliding_window", False):
            sliding = None
        eos = _as_id_list(d.get("eos_token_id"))
        for extra in _as_id_list((generation_config or {}).get("eos_token_id")):
            if extra not in eos:
                eos.append(extra)
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=is_qwen2 or llama_bias,
            o_proj_bias=llama_bias,
            mlp_bias=bool(d.get("mlp_bias", False)) and arch == "LlamaForCausalLM",
            torch_dtype=d.get("dtype") or d.get("torch_dtype"),
            eos_token_ids=eos,
            bos_token_id=d.get("bos_token_id"),
            pad_token_id=d.get("pad_token_id"),
            sliding_window=int(sliding) if sliding else None,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Reads `config.json` (and `generation_config.json` if present) from a model dir."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {path}")
        d = json.loads(config_file.read_text())
        gen_file = path / "generation_config.json"
        gen = json.loads(gen_file.read_text()) if gen_file.is_file() else None
        return cls.from_hf_dict(d, gen)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all layers of the paged cache."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_bytes

    def attention_pairs_per_token(self, attention_rate_vs_gemm: float = 0.5) -> float:
        """(query, key) pairs of attention that cost as much GPU time as one token through the
        layers' GEMMs, for the scheduler's chunk rule (`Scheduler._chunk_limit`): a token's
        linear FLOPs, 2 per weight of the layers, over a pair's 4 x heads x head_dim per layer,
        scaled by how much slower the attention kernel runs. The default 0.5 is about what one
        H100 measured on 2026-11-28: 360-400 TFLOP/s of prefill attention beside ~700 of GEMMs
        (bench/bench_prefill.py)."""
        q_width = self.num_attention_heads * self.head_dim
        kv_width = self.num_key_value_heads * self.head_dim
        weights_per_layer = (self.hidden_size * (2 * q_width + 2 * kv_width)
                             + 3 * self.hidden_size * self.intermediate_size)
        pair_flops_per_layer = 4 * q_width
        return attention_rate_vs_gemm * 2 * weights_per_layer / pair_flops_per_layer

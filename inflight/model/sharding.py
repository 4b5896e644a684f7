"""Which part of each Hugging Face tensor a tensor-parallel rank holds, decided by its name.

Megatron's split, as TensorRT-LLM and vLLM do it:
- column-parallel (output rows split): q_proj, k_proj, v_proj, gate_proj, up_proj, weights
  and biases. Rows are whole heads (q: Hq/tp heads, k/v: Hkv/tp heads; rank r's q heads use
  its own k/v heads, as GQA groups are consecutive) and whole MLP channels;
- row-parallel (input columns split): o_proj, down_proj; each rank's output is a partial sum,
  all-reduced after the layer. Their biases are added once: rank 0 holds them, the others zeros;
- vocab-parallel: embed_tokens and lm_head rows, cdiv(vocab, tp) per rank (the last shard
  padded with zero rows); the embedding all-reduces, the LM head all-gathers the logits;
- everything else (norms) replicated.

`shard_config` is the per-rank view of the model (heads, KV heads and MLP width divided) that
the decoder, the attention backend and the KV cache are sized from.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ensemble.errors import ConfigError
from inflight.intmath import cdiv
from inflight.model.config import ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def vocab_shard_size(vocab_size: int, tp_size: int) -> int:
    return cdiv(vocab_size, tp_size)


def check_divisible(config: ModelConfig, tp_size: int) -> None:
    """ConfigError naming the model's count that `tp_size` does not divide."""
    for what, count in (("attention heads", config.num_attention_heads),
                        ("key/value heads", config.num_key_value_heads),
                        ("MLP intermediate channels", config.intermediate_size)):
        if count % tp_size:
            raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the model's {count} "
                              f"{what}; use a tensor_parallel_size that divides "
                              f"{config.num_attention_heads} heads and {config.num_key_value_heads} "
                              "key/value heads")


def shard_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The per-rank model: heads, KV heads and MLP channels divided by `tp_size`."""
    if tp_size == 1:
        return config
    check_divisible(config, tp_size)
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp_size,
                               num_key_value_heads=config.num_key_value_heads // tp_size,
                               intermediate_size=config.intermediate_size // tp_size)


@dataclass(frozen=True)
class Shard:
    """Rank's part of a checkpoint tensor: `length` entries from `start` along `dim`
    (`pad_to`: zero entries appended up to that length), or, with `zeros_off_leader`, the
    whole tensor on rank 0 and zeros elsewhere (row-parallel biases)."""

    dim: int
    start: int
    length: int
    pad_to: int = 0
    zeros_off_leader: bool = False


def shard_for(name: str, full_shape: tuple[int, ...], rank: int, tp_size: int) -> Shard | None:
    """Rank `rank`'s part of checkpoint tensor `name` of `full_shape`; None: the whole tensor."""
    if tp_size == 1:
        return None
    parts = name.split(".")
    module, attr = parts[-2], parts[-1]
    if module in COLUMN_PARALLEL:
        size = full_shape[0] // tp_size
        return Shard(0, rank * size, size)
    if module in ROW_PARALLEL:
        if attr == "bias":
            return Shard(0, 0, full_shape[0], zeros_off_leader=True)
        size = full_shape[1] // tp_size
        return Shard(1, rank * size, size)
    if module in VOCAB_PARALLEL:
        size = vocab_shard_size(full_shape[0], tp_size)
        start = min(rank * size, full_shape[0])
        return Shard(0, start, min(size, full_shape[0] - start), pad_to=size)
    return None

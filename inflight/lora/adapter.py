"""One LoRA adapter's weights, in the form every path shares.

For each (layer, module) it adapts, `A` [r, in] and `B` [out, r] with the scale (α/r, or α/√r
with rsLoRA) already folded into `B`, so the module's output gains `x @ A.T @ B.T`. This is
PEFT's `lora_A` / `lora_B` layout and TensorRT-LLM's (whose converter folds the scale into its
"out" weights the same way). Modules are named as in the HF checkpoint (`MODULES`); ranks may
differ between modules of one adapter (TensorRT-LLM's rows each carry their own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ensemble.errors import InputError
from inflight.model.config import ModelConfig

# The Llama-family projections an adapter may target, by their HF names.
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Module name -> (in features, out features) in the whole (unsharded) model."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q_size), "k_proj": (hidden, kv_size), "v_proj": (hidden, kv_size),
            "o_proj": (q_size, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


@dataclass(frozen=True)
class LoraAdapter:
    """`weights[(layer, module)] = (A [r, in], B [out, r])`, B scaled; float32 or the model's
    dtype, on the host."""

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def max_rank(self) -> int:
        return max((a.shape[0] for a, _ in self.weights.values()), default=0)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())

    def check(self, config: ModelConfig, max_rank: int | None = None) -> None:
        """Raises InputError unless every entry fits the model: a known module of an existing
        layer, A [r, in] and B [out, r] of that module's shape, r within `max_rank`."""
        num_layers, shapes = config.num_hidden_layers, module_shapes(config)
        for (layer, module), (a, b) in self.weights.items():
            where = f"LoRA weights of layer {layer} {module}"
            if module not in shapes:
                raise InputError(f"{where}: the model has no module {module} (LoRA applies to "
                                 f"{', '.join(MODULES)})")
            if not 0 <= layer < num_layers:
                raise InputError(f"{where}: the model has {num_layers} layers")
            in_features, out_features = shapes[module]
            rank = a.shape[0]
            if a.shape != (rank, in_features) or b.shape != (out_features, rank):
                raise InputError(f"{where}: expected A [{rank}, {in_features}] and B [{out_features}, {rank}], "
                                 f"got A {list(a.shape)} and B {list(b.shape)}")
            if rank < 1 or (max_rank is not None and rank > max_rank):
                raise InputError(f"{where}: rank {rank} is outside 1 to {max_rank} "
                                 "(lora_cache_max_adapter_size)")


# Tensor parallelism (`inflight.model.sharding`): a column-parallel projection's rank holds rows
# of its output, so B's rows; a row-parallel one holds columns of its input, so A's columns,
# its partial delta summed by the projection's all-reduce like the base output.
_ROW_PARALLEL = ("o_proj", "down_proj")


def shard(module: str, a: torch.Tensor, b: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s part of one module's (A, B)."""
    if size == 1:
        return a, b
    if module in _ROW_PARALLEL:
        width = a.shape[1] // size
        return a[:, rank * width:(rank + 1) * width], b
    height = b.shape[0] // size
    return a, b[rank * height:(rank + 1) * height]


def pack_adapter(adapter: LoraAdapter) -> torch.Tensor:
    """The adapter as one int64 tensor (the ranks' message payload): the entry count, per
    entry (layer, module index, rank, in, out), then every A and B in fp32, bit for bit."""
    entries = list(adapter.weights.items())
    header = [len(entries)]
    floats = []
    for (layer, module), (a, b) in entries:
        header += [layer, MODULES.index(module), a.shape[0], a.shape[1], b.shape[0]]
        floats += [a.reshape(-1).float(), b.reshape(-1).float()]
    data = torch.cat(floats) if floats else torch.zeros(0)
    data = torch.cat([data, data.new_zeros(data.numel() % 2)])  # whole int64 words
    return torch.cat([torch.tensor(header, dtype=torch.int64), data.view(torch.int64)])


def unpack_adapter(packed: torch.Tensor) -> LoraAdapter:
    count = int(packed[0])
    header = packed[1:1 + 5 * count].view(count, 5).tolist()
    data = packed[1 + 5 * count:].view(torch.float32)
    weights, offset = {}, 0
    for layer, module, rank, in_features, out_features in header:
        a = data[offset:offset + rank * in_features].view(rank, in_features)
        offset += rank * in_features
        b = data[offset:offset + out_features * rank].view(out_features, rank)
        offset += out_features * rank
        weights[(layer, MODULES[module])] = (a, b)
    return LoraAdapter(weights)

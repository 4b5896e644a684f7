"""How a step applies its rows' adapters: the device copies of adapters (`LoraDeviceCache`)
and the step's token → adapter grouping (`LoraBatch`) that the model's projections call.

A projection computes `y = x @ W.T` for every token at once; then, for each adapter in the
step, its tokens' rows of `y` gain `(x @ A.T) @ B.T` (B carries the scale). Tokens without an
adapter are left alone, so base-model rows share the step with adapted ones. A packed
projection (q/k/v, gate/up) names its parts in order, and each part's columns get that part's
delta. Steps with no adapter pass no batch, and the model does nothing extra.

This is the plain torch path (CPU, and eager CUDA steps): one pair of small GEMMs per adapter
and module. The device cache keeps at most `max_loras` adapters (the most a step may use, which
the scheduler enforces), each in the model's dtype, evicting the least recently used one that
the step does not need.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inflight.lora.adapter import shard
from inflight.lora.cache import CachedLora

DeviceAdapter = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


class LoraDeviceCache:
    def __init__(self, max_loras: int, dtype: torch.dtype, device: torch.device, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        """`tp_rank` of `tp_size`: keep that tensor-parallel rank's shard of each adapter."""
        self.max_loras = max_loras
        self.dtype = dtype
        self.device = device
        self.tp = (tp_rank, tp_size)
        self._adapters: OrderedDict[int, DeviceAdapter] = OrderedDict()  # by CachedLora.key

    def resident(self, key: int) -> bool:
        return key in self._adapters

    def batch(self, row_loras: Sequence[CachedLora | None], row_num_tokens: Sequence[int]) -> LoraBatch | None:
        """The step's grouping, its adapters copied to the device first where needed; None when
        no row has an adapter."""
        keys = {lora.key: lora for lora in row_loras if lora is not None}
        if not keys:
            return None
        if len(keys) > self.max_loras:
            raise ValueError(f"a step uses {len(keys)} LoRA adapters; at most max_loras ({self.max_loras}) fit")
        for key, lora in keys.items():
            self._load(lora, set(keys))
        token_rows: dict[int, list[int]] = {}
        start = 0
        for lora, count in zip(row_loras, row_num_tokens):
            if lora is not None:
                token_rows.setdefault(lora.key, []).extend(range(start, start + count))
            start += count
        groups = []
        for key, rows in token_rows.items():
            index = None if len(rows) == start else torch.tensor(rows, dtype=torch.int64).to(self.device)
            groups.append((self._adapters[key], index))
        return LoraBatch(groups)

    def _load(self, lora: CachedLora, needed: set[int]) -> None:
        if lora.key in self._adapters:
            self._adapters.move_to_end(lora.key)
            return
        for key in list(self._adapters):
            if len(self._adapters) < self.max_loras:
                break
            if key not in needed:
                del self._adapters[key]
        loaded = {}
        for name, (a, b) in lora.adapter.weights.items():
            a, b = shard(name[1], a, b, *self.tp)
            loaded[name] = (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
        self._adapters[lora.key] = loaded


@dataclass(frozen=True)
class LoraBatch:
    """One step's adapters: (device weights, token indices of the flattened batch or None for
    every token) per adapter."""

    groups: list[tuple[DeviceAdapter, torch.Tensor | None]]

    def project(self, layer: int, parts: Sequence[tuple[str, int]], x: Any, linear: Callable,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """linear(x) plus the adapters' delta (`apply`); `residual` (see `SlotBatch.project`) is
        not used: the delta goes into the result."""
        y = linear(x)
        self.apply(layer, parts, x, y)
        return y

    def apply(self, layer: int, parts: Sequence[tuple[str, int]], x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, sum of part sizes] += each token's adapter delta of `parts` ((module, out
        size) in column order), in place. x [T, in] is the projection's input: a tensor, or an
        FP8 projection's `QuantizedInput`, whose values the adapters read dequantized."""
        if not isinstance(x, torch.Tensor):
            x = (x.q.float() * x.scale).to(x.dtype)
        for weights, index in self.groups:
            xs = x if index is None else x.index_select(0, index)
            column = 0
            for module, size in parts:
                pair = weights.get((layer, module))
                if pair is not None:
                    a, b = pair
                    delta = (xs @ a.T) @ b.T  # [n, r] -> [n, size]
                    target = y[:, column:column + size]
                    if index is None:
                        target.add_(delta)
                    else:
                        target.index_add_(0, index, delta)
                column += size

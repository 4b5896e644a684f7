"""Adapters on the GPU for the Triton kernels: a fixed number of slots in stacked buffers, and
the step's token → slot segments that the kernels read (eager, or from a CUDA graph's static
buffers).

Per layer and projection group (q/k/v, o, gate/up, down: what one packed projection computes),
`a` [S, P, R, K] and `b` [S, N, R] in the model's dtype (`inflight.kernels.lora`'s layouts): S
slots, P parts, R the rank bound (`max_adapter_size`, rounded up to a power of two ≥ 16), K
the group's input width, N its packed output width. An adapter of rank r fills rows :r of its
slot and leaves zeros beyond, so every adapter runs the same kernels. The buffers are allocated
at start-up, before the KV cache is sized, so they are part of the measured peak.

A step's rows map to slots; an adapter not in a slot is copied into a free one, or into the
least recently used one that the step does not need. The scheduler keeps a step's adapters
within `max_loras` = S.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from inflight.lora.adapter import shard
from inflight.lora.cache import CachedLora
from inflight.model.config import ModelConfig
from inflight.platform import to_device

# group -> its parts in output-column order, and the module whose input it reads
GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
          "down": ("down_proj",)}
GROUP_OF = {part: group for group, parts in GROUPS.items() for part in parts}
MIN_RANK_BOUND = 16  # tl.dot's smallest tile


def rank_bound(max_adapter_size: int) -> int:
    bound = MIN_RANK_BOUND
    while bound < max_adapter_size:
        bound *= 2
    return bound


@dataclass(frozen=True)
class Segments:
    """The kernels' view of one step: tokens grouped by slot, and the token tiles the kernels'
    grids run over (`inflight.kernels.lora.TileTable`), on the device."""

    sorted_tokens: torch.Tensor  # [M] int32
    slot_starts: torch.Tensor  # [S + 1] int32
    max_tokens_per_slot: int
    shrink_tiles: Any  # TileTable of BLOCK_M rows
    expand_tiles: Any  # TileTable of expand_block_m rows


def _aligned(values: list[int]) -> list[int]:
    """Padded to 16 bytes of int32: each part of the staged buffer starts aligned, and Triton,
    which specializes a kernel on its pointers' alignment, compiles one variant, the graphs'."""
    return values + [0] * (-len(values) % 4)


def _part_sizes(num_tokens: int, num_slots: int, shrink_max: int, expand_max: int) -> list[int]:
    return [len(_aligned([0] * n)) for n in (num_tokens, num_slots + 1, 1 + 2 * shrink_max, 1 + 2 * expand_max)]


def _host_segments(token_slots: list[int], num_slots: int, shrink_max: int, expand_block_m: int,
                   expand_max: int) -> tuple[list[int], int]:
    """(sorted tokens + slot starts + both tile tables as one int32 list, each part 16-byte
    aligned; the number of sorted tokens)."""
    from inflight.kernels.lora import BLOCK_M, lora_segments, lora_tiles

    sorted_tokens, starts, _ = lora_segments(token_slots, num_slots)
    values = _aligned(sorted_tokens) + _aligned(starts) + _aligned(lora_tiles(starts, BLOCK_M, shrink_max)) + \
        _aligned(lora_tiles(starts, expand_block_m, expand_max))
    return values, len(sorted_tokens)


def eager_segments(token_slots: list[int], num_slots: int, device: torch.device) -> Segments:
    """An eager step's segments, sized to its own tokens (one host -> device copy)."""
    from inflight.kernels.lora import BLOCK_M, TileTable, expand_block_m, lora_segments, max_tiles_for

    _, _, longest = lora_segments(token_slots, num_slots)
    num_tokens = max(1, sum(slot >= 0 for slot in token_slots))
    block_m = expand_block_m(longest)
    shrink_max, expand_max = max_tiles_for(num_tokens, num_slots, BLOCK_M), max_tiles_for(num_tokens, num_slots, block_m)
    values, m = _host_segments(token_slots, num_slots, shrink_max, block_m, expand_max)
    staged = to_device(torch.tensor(values, dtype=torch.int32), device)
    views = staged.split(_part_sizes(m, num_slots, shrink_max, expand_max))
    return Segments(views[0][:m], views[1][:num_slots + 1], max(longest, 1),
                    TileTable(views[2][:1 + 2 * shrink_max], shrink_max, BLOCK_M),
                    TileTable(views[3][:1 + 2 * expand_max], expand_max, block_m))


class SegmentBuffers:
    """A CUDA graph's static segments for steps of up to `max_tokens` tokens (expand tiles of
    `expand_block_m` rows), staged each step with one copy; `segments(n)` gives a bucket of n
    tokens its views (grids sized for n)."""

    def __init__(self, max_tokens: int, num_slots: int, expand_block_m: int, device: torch.device) -> None:
        from inflight.kernels.lora import BLOCK_M, max_tiles_for

        self.num_slots, self.expand_block_m = num_slots, expand_block_m
        self.shrink_max = max_tiles_for(max_tokens, num_slots, BLOCK_M)
        self.expand_max = max_tiles_for(max_tokens, num_slots, expand_block_m)
        self.sizes = _part_sizes(max_tokens, num_slots, self.shrink_max, self.expand_max)
        self.buffer = torch.zeros(sum(self.sizes), dtype=torch.int32, device=device)
        self.views = self.buffer.split(self.sizes)

    def segments(self, num_tokens: int) -> Segments:
        from inflight.kernels.lora import BLOCK_M, TileTable, max_tiles_for

        shrink_max = max_tiles_for(num_tokens, self.num_slots, BLOCK_M)
        expand_max = max_tiles_for(num_tokens, self.num_slots, self.expand_block_m)
        return Segments(self.views[0][:num_tokens], self.views[1][:self.num_slots + 1], num_tokens,
                        TileTable(self.views[2][:1 + 2 * shrink_max], shrink_max, BLOCK_M),
                        TileTable(self.views[3][:1 + 2 * expand_max], expand_max, self.expand_block_m))

    def clear(self) -> None:
        """No token in any segment (capture: nothing stored, nothing read)."""
        self.buffer.zero_()

    def stage(self, token_slots: list[int]) -> None:
        """The step's segments into the static buffers (queued; no sync)."""
        values, m = _host_segments(token_slots, self.num_slots, self.shrink_max, self.expand_block_m,
                                   self.expand_max)
        staged = to_device(torch.tensor(values, dtype=torch.int32), self.buffer.device)
        parts = staged.split(_part_sizes(m, self.num_slots, self.shrink_max, self.expand_max))
        for view, part in zip(self.views, parts):
            view[:part.shape[0]].copy_(part, non_blocking=True)


class LoraSlots:
    def __init__(self, config: ModelConfig, num_slots: int, max_adapter_size: int, dtype: torch.dtype,
                 device: torch.device, tp_rank: int = 0, tp_size: int = 1) -> None:
        """`config`: this rank's shard of the model (`shard_config`); adapters are cut to it."""
        self.num_slots = num_slots
        self.tp = (tp_rank, tp_size)
        self.rank = rank_bound(max_adapter_size)
        hidden, inter = config.hidden_size, config.intermediate_size
        q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
        self.widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": hidden, "gate_proj": inter,
                       "up_proj": inter, "down_proj": hidden}
        inputs = {"qkv": hidden, "o": q, "gate_up": hidden, "down": inter}
        self.col_starts = {group: _starts([self.widths[p] for p in parts]) for group, parts in GROUPS.items()}

        def buffers(group):
            parts = GROUPS[group]
            return (torch.zeros(num_slots, len(parts), self.rank, inputs[group], dtype=dtype, device=device),
                    torch.zeros(num_slots, self.col_starts[group][-1], self.rank, dtype=dtype, device=device))

        self.layers = [{group: buffers(group) for group in GROUPS} for _ in range(config.num_hidden_layers)]
        # SlotBatch.project's shrinks run here, beside the base GEMMs (CUDA only)
        self.side_stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # CachedLora.key -> slot, LRU first

    def resident(self, key: int) -> bool:
        return key in self._slot_of

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for pair in layer.values() for t in pair)

    def token_slots(self, row_loras: Sequence[CachedLora | None], row_num_tokens: Sequence[int]) -> list[int]:
        """Each token's slot (-1: the base model), adapters loaded where needed."""
        needed = {lora.key for lora in row_loras if lora is not None}
        if len(needed) > self.num_slots:
            raise ValueError(f"a step uses {len(needed)} LoRA adapters; at most max_loras ({self.num_slots}) fit")
        slot_of_row = []
        for lora in row_loras:
            slot_of_row.append(-1 if lora is None else self._slot(lora, needed))
        return [slot for slot, count in zip(slot_of_row, row_num_tokens) for _ in range(count)]

    def _slot(self, lora: CachedLora, needed: set[int]) -> int:
        slot = self._slot_of.get(lora.key)
        if slot is not None:
            self._slot_of.move_to_end(lora.key)
            return slot
        used = set(self._slot_of.values())
        free = [s for s in range(self.num_slots) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(key for key in self._slot_of if key not in needed)
            slot = self._slot_of.pop(victim)
        self._load(lora, slot)
        self._slot_of[lora.key] = slot
        return slot

    def _load(self, lora: CachedLora, slot: int) -> None:
        """Copies the adapter into `slot` (queued on the current stream: steps that read the
        slot run after it), zeros where it has nothing."""
        for layer in self.layers:
            for a, b in layer.values():
                a[slot].zero_()
                b[slot].zero_()
        for (index, module), (a, b) in lora.adapter.weights.items():
            a, b = shard(module, a, b, *self.tp)
            group = GROUP_OF[module]
            stacked_a, stacked_b = self.layers[index][group]
            part = GROUPS[group].index(module)
            start = self.col_starts[group][part]
            rank = a.shape[0]
            stacked_a[slot, part, :rank].copy_(a, non_blocking=True)
            stacked_b[slot, start:start + b.shape[0], :rank].copy_(b, non_blocking=True)


def _starts(widths: list[int]) -> tuple[int, ...]:
    starts = [0]
    for width in widths:
        starts.append(starts[-1] + width)
    return tuple(starts)


class SlotBatch:
    """A step's adapters for the model's projections (`project` / `apply`, as `LoraBatch`),
    through the Triton kernels over `slots` and `segments`."""

    def __init__(self, slots: LoraSlots, segments: Segments) -> None:
        self.slots = slots
        self.segments = segments

    def project(self, layer: int, parts: Sequence[tuple[str, int]], x, linear: Callable,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """linear(x) plus the adapters' delta. On CUDA the shrink runs on the slots' side stream
        while the base GEMM runs (both read only x; a decode step's shrink is latency-bound), so
        only the expand waits for the GEMM: one small kernel on the critical path, not two.
        `residual`: a tensor that the result is added to next and that nothing reads or writes
        until then (the residual stream, for o_proj and down_proj at tensor-parallel size 1):
        the expand adds the delta there, on the side stream too, and neither kernel waits for
        the GEMM. The fork and join are stream waits, which CUDA graph capture records as edges."""
        side = self.slots.side_stream
        if side is None:
            y = linear(x)
            self.apply(layer, parts, x, y)
            return y
        adapter_x = _dequantized(x)  # before the fork: every allocation stays on the main stream
        a, b, col_starts = self._group(layer, parts)
        shrunk = _shrink_out(adapter_x, a)
        main = torch.cuda.current_stream(adapter_x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self._shrink(adapter_x, a, shrunk)
            if residual is not None:
                self._expand(shrunk, b, col_starts, residual)
        y = linear(x)
        main.wait_stream(side)
        if residual is None:
            self._expand(shrunk, b, col_starts, y)
        return y

    def apply(self, layer: int, parts: Sequence[tuple[str, int]], x, y: torch.Tensor) -> None:
        """y += the adapters' delta of `parts`, x the projection's input (or an FP8 projection's
        `QuantizedInput`)."""
        x = _dequantized(x)
        a, b, col_starts = self._group(layer, parts)
        self._expand(self._shrink(x, a, _shrink_out(x, a)), b, col_starts, y)

    def _group(self, layer: int, parts: Sequence[tuple[str, int]]) -> tuple[torch.Tensor, torch.Tensor,
                                                                               tuple[int, ...]]:
        """(a, b, column starts) of the packed projection that `parts` belong to."""
        group = GROUP_OF[parts[0][0]]
        return self.slots.layers[layer][group] + (self.slots.col_starts[group],)

    def _shrink(self, x: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        from inflight.kernels import lora_shrink

        seg = self.segments
        return lora_shrink(x, a, seg.sorted_tokens, seg.slot_starts, seg.max_tokens_per_slot, out=out,
                           tiles=seg.shrink_tiles)

    def _expand(self, shrunk: torch.Tensor, b: torch.Tensor, col_starts: tuple[int, ...],
                y: torch.Tensor) -> None:
        from inflight.kernels import lora_expand

        seg = self.segments
        lora_expand(shrunk, b, col_starts, seg.sorted_tokens, seg.slot_starts, seg.max_tokens_per_slot, y,
                    tiles=seg.expand_tiles)


def _dequantized(x) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    return (x.q.float() * x.scale).to(x.dtype)  # an FP8 projection's QuantizedInput


def _shrink_out(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """lora_shrink's split partial sums [splits, T, P R] fp32, allocated on the caller's stream."""
    from inflight.kernels.lora import shrink_partials_shape

    return torch.empty(shrink_partials_shape(x, a), dtype=torch.float32, device=x.device)

"""The CUDA path's adapter slots and segments (inflight/lora/slots.py), run on the CPU through
Triton's interpreter: every projection group's deltas through the kernels equal the torch path's
(inflight/lora/batch.py) for a step mixing base rows and adapters of different ranks, with the
segments built for an eager step and staged into a graph's static buffers."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

from inflight.lora.adapter import module_shapes
from inflight.lora.batch import LoraDeviceCache
from inflight.lora.cache import CachedLora
from inflight.lora.slots import GROUPS, LoraSlots, SegmentBuffers, SlotBatch, eager_segments
from inflight.model.config import ModelConfig
from tools.checkpoints import random_lora_adapter, tiny_hf_model

pytest.importorskip("triton")


@pytest.mark.parametrize("staged", [False, True])
def test_slot_kernels_give_the_torch_paths_deltas(staged):
    config = ModelConfig.from_hf_dict(tiny_hf_model("llama3").config.to_dict())
    loras = [CachedLora(1, 101, random_lora_adapter(config, 8, 1)),
             CachedLora(2, 102, random_lora_adapter(config, 4, 2, ["q_proj", "v_proj", "down_proj"]))]
    rows = [None, loras[0], loras[1], loras[0], None]
    counts = [3, 1, 5, 2, 1]  # a prompt chunk, decode rows, a longer chunk
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    slots = LoraSlots(config, 3, 8, torch.float32, device)
    token_slots = slots.token_slots(rows, counts)
    if staged:  # a graph's static buffers, sized for more tokens than the step has
        buffers = SegmentBuffers(32, slots.num_slots, 16, device)
        buffers.stage(token_slots)
        segments = buffers.segments(32)
    else:
        segments = eager_segments(token_slots, slots.num_slots, device)
    kernels = SlotBatch(slots, segments)
    reference = LoraDeviceCache(3, torch.float32, device).batch(rows, counts)
    shapes = module_shapes(config)
    generator = torch.Generator().manual_seed(3)
    num_tokens = sum(counts)
    for layer in range(config.num_hidden_layers):
        for parts in GROUPS.values():
            widths = [shapes[m][1] for m in parts]
            x = torch.randn(num_tokens, shapes[parts[0]][0], generator=generator).to(device)
            y = torch.randn(num_tokens, sum(widths), generator=generator).to(device)
            want, got = y.clone(), y.clone()
            reference.apply(layer, tuple(zip(parts, widths)), x, want)
            kernels.apply(layer, tuple(zip(parts, widths)), x, got)
            # Both are fp32 sums of the same products in other orders: a few ulps of their
            # magnitude (|x| |A| |B| summed over the input width and the rank).
            scale = float((x.abs().max() ** 2) * shapes[parts[0]][0] * 8 + y.abs().max())
            torch.testing.assert_close(got, want, rtol=0, atol=64 * 2.0 ** -23 * scale)
            base = [i for i, slot in enumerate(token_slots) if slot < 0]
            assert torch.equal(got[base], y[base])

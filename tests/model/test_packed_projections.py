"""Packed q/k/v and gate/up projections (CUDA's layout), checked on the CPU: the loader still
checks every HF tensor by name and shape, each packed block holds its checkpoint tensor, and
the packed model computes what the checkpoint's separate projections compute."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import inflight.model.loader as loader
from inflight.model.attention import StepMetadata
from inflight.model.llama import PackedLinear
from inflight.model.loader import allocate_kv_caches, checkpoint_layout, load_model
from tools.checkpoints import TINY_KINDS, save_tiny_checkpoint

BLOCK = 4
# Packing changes which GEMM call computes each output, which may reorder the fp32
# accumulation over `hidden`: float noise, far below this (logits are O(1) over 3 layers).
ATOL = 1e-4


@pytest.fixture
def packed(monkeypatch):
    """load_model with packed projections, as on CUDA."""
    monkeypatch.setattr(loader, "packs_projections", lambda device: True)
    return load_model


def _logits(model, config):
    caches = allocate_kv_caches(config, 8, BLOCK, torch.float32, "cpu")
    rows = [(0, 7, [3, 1]), (0, 5, [4, 6])]
    step = StepMetadata.build(rows, BLOCK, "cpu", input_ids=[5, 9, 30, 2, 77, 41, 12, 8, 1, 400, 3, 3])
    hidden = model(step.input_ids, step.positions, caches, model.attention_backend.build_metadata(step))
    return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_packed_model_matches_the_separate_projections(kind, tmp_path, packed):
    hf = save_tiny_checkpoint(kind, tmp_path)
    separate, config = load_model(tmp_path, torch.float32, "cpu")
    model, _ = packed(tmp_path, torch.float32, "cpu")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert isinstance(attn.qkv_proj, PackedLinear) and isinstance(mlp.gate_up_proj, PackedLinear)
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")
    # Every HF tensor has a place, and holds the checkpoint's values there.
    layout = checkpoint_layout(model)
    assert set(layout) == set(hf.state_dict())
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, ref in hf.state_dict().items():
        target = layout[name]
        ours = params[target.param][target.start:target.start + target.shape[0]]
        assert torch.equal(ours, ref), name
    torch.testing.assert_close(_logits(model, config), _logits(separate, config), atol=ATOL, rtol=1e-4)


def test_packed_loader_still_names_missing_and_misshapen_tensors(tmp_path, packed):
    save_tiny_checkpoint("llama3", tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors: model.layers.1.mlp.up_proj.weight"):
        packed(tmp_path, torch.float32, "cpu")
    weights["model.layers.1.mlp.up_proj.weight"] = torch.zeros(128, 64)
    weights["model.layers.0.self_attn.k_proj.bias"] = torch.zeros(64)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.bias has shape \(64,\).*"
                                         r"expected \(32,\)"):
        packed(tmp_path, torch.float32, "cpu")

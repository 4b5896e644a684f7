"""LoRA adapter formats: HF PEFT folders (`inflight.lora.peft`), TensorRT-LLM's request rows
(`inflight.lora.nvidia`) and the converter between them (`tools/lora_convert.py`).

The reference is PEFT itself: adapters are made with `get_peft_model` on tiny random
checkpoints (tools/checkpoints.py) and saved with `save_pretrained`, and every module's delta
`B @ A` is held to PEFT's own `get_delta_weight`.
"""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ensemble.errors import InputError
from inflight.lora.adapter import MODULES, LoraAdapter
from inflight.lora.nvidia import from_nvidia, to_nvidia
from inflight.lora.peft import read_peft
from inflight.model.config import ModelConfig
from tools import lora_convert
from tools.checkpoints import save_tiny_checkpoint, tiny_hf_model

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
PREFIX = "base_model.model.model.layers"


def make_adapter(folder, kind="llama3", seed=0, **lora_kwargs):
    """A PEFT adapter on the tiny `kind` checkpoint, saved to `folder`: (peft model, ModelConfig).
    init_lora_weights=False makes B random too (PEFT's default zeroes it: a delta of 0)."""
    model = tiny_hf_model(kind)
    torch.manual_seed(seed)
    from peft import LoraConfig, get_peft_model  # here: peft imports triton (see conftest's interpreter)

    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora_kwargs))
    peft_model.save_pretrained(folder)
    return peft_model, ModelConfig.from_hf_dict(model.config.to_dict())


def peft_delta(peft_model, layer, module):
    decoder = peft_model.base_model.model.model.layers[layer]
    owner = decoder.self_attn if module in ATTENTION else decoder.mlp
    return getattr(owner, module).get_delta_weight("default")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """r=4, alpha=8 on all seven projections of every layer of the tiny Llama."""
    folder = tmp_path_factory.mktemp("peft_llama")
    peft_model, config = make_adapter(folder, r=4, lora_alpha=8, target_modules=list(MODULES))
    return peft_model, config, folder


@pytest.fixture(scope="module")
def rslora(tmp_path_factory):
    """r=8 rsLoRA on three modules of two layers of the tiny Mistral, whose head_dim (32) makes
    q_proj 64 -> 128 and o_proj 128 -> 64: in and out cannot be confused."""
    folder = tmp_path_factory.mktemp("peft_rslora")
    peft_model, config = make_adapter(folder, kind="mistral", seed=1, r=8, lora_alpha=16, use_rslora=True,
                                      target_modules=["q_proj", "o_proj", "down_proj"],
                                      layers_to_transform=[0, 2])
    return peft_model, config, folder


def assert_matches_peft(adapter, peft_model):
    for (layer, module), (a, b) in adapter.weights.items():
        # Both sides are fp32 products of the same fp32 factors, in another order: PEFT computes
        # (B @ A) * scale, we fold the scale first, (B * scale) @ A. Each element is a sum of r <= 8
        # products, so they differ by a few roundings: |err| <= (r + 2) * eps32 * (|B||A|)_ij * scale
        # ~ 1e-6 relative at worst; rtol 1e-5 holds that, and atol 1e-6 covers elements near 0,
        # where cancellation makes the relative error meaningless (|delta| here is at most ~1).
        assert torch.allclose(b @ a, peft_delta(peft_model, layer, module), rtol=1e-5, atol=1e-6), \
            (layer, module)


def test_read_peft_matches_peft_delta(llama):
    peft_model, config, folder = llama
    adapter = read_peft(folder, config)
    assert set(adapter.weights) == {(layer, m) for layer in range(config.num_hidden_layers) for m in MODULES}
    assert adapter.max_rank == 4
    assert all(a.dtype == b.dtype == torch.float32 for a, b in adapter.weights.values())
    assert_matches_peft(adapter, peft_model)


def test_read_peft_rslora_subset(rslora):
    peft_model, config, folder = rslora
    adapter = read_peft(folder, config)
    assert set(adapter.weights) == {(layer, m) for layer in (0, 2) for m in ("q_proj", "o_proj", "down_proj")}
    assert adapter.weights[(0, "q_proj")][1].shape == (128, 8)
    assert adapter.weights[(0, "o_proj")][0].shape == (8, 128)
    assert_matches_peft(adapter, peft_model)
    # The scale is alpha / sqrt(r), not alpha / r.
    raw = load_file(folder / "adapter_model.safetensors")
    b = raw[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(adapter.weights[(0, "q_proj")][1], b * (16 / math.sqrt(8)))


def test_read_peft_dtype_legacy_bin_and_named_keys(llama, tmp_path):
    _peft_model, config, folder = llama
    reference = read_peft(folder, config)
    half = read_peft(folder, config, dtype=torch.float16)
    for key, (a, b) in half.weights.items():  # one rounding, after scaling in fp32
        assert a.dtype == b.dtype == torch.float16
        assert torch.equal(b, reference.weights[key][1].half())
    # A legacy pickle, with the adapter-name segment a raw PeftModel state_dict keeps.
    tensors = {k.replace(".weight", ".default.weight"): v
               for k, v in load_file(folder / "adapter_model.safetensors").items()}
    shutil.copy(folder / "adapter_config.json", tmp_path / "adapter_config.json")
    torch.save(tensors, tmp_path / "adapter_model.bin")
    legacy = read_peft(tmp_path, config)
    assert all(torch.equal(legacy.weights[k][1], b) for k, (_, b) in reference.weights.items())
    # Without the base model's config the shapes come from the tensors.
    unchecked = read_peft(folder, None)
    assert all(torch.equal(unchecked.weights[k][0], a) for k, (a, _) in reference.weights.items())


def test_read_peft_checks_the_base_model(rslora, llama):
    _, llama_config, _ = llama
    mistral_q = r"layer 0 q_proj: expected A \[8, 64\] and B \[64, 8\], got A \[8, 64\] and B \[128, 8\]"
    with pytest.raises(InputError, match=mistral_q):
        read_peft(rslora[2], llama_config)  # Mistral's q_proj is 64 -> 128
    with pytest.raises(InputError, match="rank 4 is outside 1 to 2"):
        read_peft(llama[2], llama_config, max_rank=2)


@pytest.mark.parametrize(("lora_kwargs", "message"), [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 2}}, "alpha_pattern"),
    ({"bias": "lora_only"}, "bias: 'lora_only'"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules: module lm_head"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules: module embed_tokens"),
    # A regex cannot be checked from the config: the tensor keys are.
    ({"target_modules": r".*(q_proj|lm_head)"}, "adapter tensor base_model.model.lm_head."),
    ({"target_modules": r".*(q_proj|embed_tokens)"}, "adapter tensor base_model.model.model.embed_tokens"),
])
def test_read_peft_refuses_what_is_not_built(tmp_path, lora_kwargs, message):
    kwargs = {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]} | lora_kwargs
    make_adapter(tmp_path, **kwargs)
    with pytest.raises(InputError, match=re.escape(message)):
        read_peft(tmp_path, None)


def rewrite(folder, tmp_path, edit_tensors=None, edit_config=None):
    """A copy of the adapter in `folder` with its tensors / config edited."""
    tmp_path.mkdir()
    tensors = load_file(folder / "adapter_model.safetensors")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    save_file(edit_tensors(tensors) if edit_tensors else tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(edit_config(cfg) if edit_config else cfg))
    return tmp_path


def test_read_peft_refuses_broken_folders(llama, tmp_path):
    folder = llama[2]
    b_key = f"{PREFIX}.1.mlp.up_proj.lora_B.weight"
    lonely = rewrite(folder, tmp_path / "a", lambda t: {k: v for k, v in t.items() if k != b_key})
    with pytest.raises(InputError, match=r"layers\.1\.mlp\.up_proj\.lora_A\.weight has no matching lora_B"):
        read_peft(lonely, None)
    fused = {f"{PREFIX}.0.self_attn.qkv_proj.lora_A.weight": torch.zeros(4, 64),
             f"{PREFIX}.0.self_attn.qkv_proj.lora_B.weight": torch.zeros(128, 4)}
    with pytest.raises(InputError, match="fused module qkv_proj is not supported"):
        read_peft(rewrite(folder, tmp_path / "b", lambda t: fused), None)
    with pytest.raises(InputError, match="expected rank 8"):  # r in the config disagrees with A
        read_peft(rewrite(folder, tmp_path / "c", edit_config=lambda c: c | {"r": 8}), None)
    with pytest.raises(InputError, match="peft_type: 'IA3'"):
        read_peft(rewrite(folder, tmp_path / "d", edit_config=lambda c: c | {"peft_type": "IA3"}), None)
    with pytest.raises(InputError, match="no adapter_config.json"):
        read_peft(tmp_path, None)


# --- TensorRT-LLM rows ---

def test_nvidia_round_trip_is_exact(llama):
    _, config, folder = llama
    adapter = read_peft(folder, config)
    weights, rows = to_nvidia(adapter, np.float32)
    assert weights.dtype == np.float32 and rows.dtype == np.int32
    assert weights.shape == (21, 4 * (64 + 128)) and rows.shape == (21, 3)  # 3 layers x 7 modules
    back = from_nvidia(weights, rows, config)
    assert back.weights.keys() == adapter.weights.keys()
    for key, (a, b) in adapter.weights.items():
        assert torch.equal(back.weights[key][0], a) and torch.equal(back.weights[key][1], b), key


def test_nvidia_rows_match_hand_layout(llama):
    _, config, folder = llama
    raw = load_file(folder / "adapter_model.safetensors")
    weights, rows = to_nvidia(read_peft(folder, config), np.float32)
    a = raw[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"].numpy()
    b = raw[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"].numpy()
    expected = np.concatenate([a.flatten(), (np.float32(8 / 4) * b).flatten()])
    expected = np.pad(expected, (0, weights.shape[1] - expected.size))
    assert rows[0].tolist() == [1, 0, 4]  # layer 0 sorts first, q_proj first in MODULES
    np.testing.assert_array_equal(weights[0], expected)
    ids = dict(zip(MODULES, [module_id for module_id, layer, _ in rows.tolist() if layer == 0]))
    assert ids == {"q_proj": 1, "k_proj": 2, "v_proj": 3, "o_proj": 4, "gate_proj": 5, "up_proj": 7,
                   "down_proj": 6}
    half, _ = to_nvidia(read_peft(folder, config))  # default: float16, rounded once
    assert half.dtype == np.float16
    np.testing.assert_array_equal(half[0], expected.astype(np.float16))


def test_nvidia_fused_qkv_splits_with_shared_a(llama):
    _, config, _ = llama  # q 64 out, k and v 32 each, hidden 64
    r, generator = 3, torch.Generator().manual_seed(0)
    a, b = torch.randn(r, 64, generator=generator), torch.randn(128, r, generator=generator)
    row = torch.cat([a.flatten(), b.flatten(), torch.zeros(10)]).half()
    adapter = from_nvidia(row[None, None], torch.tensor([[[0, 2, r]]], dtype=torch.int32), config)
    assert set(adapter.weights) == {(2, "q_proj"), (2, "k_proj"), (2, "v_proj")}
    shared = adapter.weights[(2, "q_proj")][0]
    assert all(adapter.weights[(2, m)][0] is shared for m in ("k_proj", "v_proj"))
    assert torch.equal(shared, a.half().float())
    for module, part in zip(("q_proj", "k_proj", "v_proj"), b.half().float().split([64, 32, 32])):
        assert torch.equal(adapter.weights[(2, module)][1], part)


def test_nvidia_accepts_leading_batch_dim(llama):
    _, config, folder = llama
    adapter = read_peft(folder, config)
    weights, rows = to_nvidia(adapter, np.float32)
    batched = from_nvidia(weights[None], rows[None], config, dtype=torch.float16)
    assert all(torch.equal(batched.weights[k][1], b.half()) for k, (_, b) in adapter.weights.items())


@pytest.mark.parametrize(("row", "width", "max_rank", "message"), [
    ([99, 0, 2], 1000, None, "lora_config row 0: module id 99 is unknown"),
    ([9, 0, 2], 1000, None, r"lora_config row 0: module id 9 \(cross_attn_q\) is not supported"),
    ([1, 3, 2], 1000, None, "lora_config row 0: layer 3 is out of range"),
    ([1, -1, 2], 1000, None, "lora_config row 0: layer -1 is out of range"),
    ([1, 0, 0], 1000, None, "adapter size 0 must be at least 1"),
    ([1, 0, 8], 2000, 4, r"adapter size 8 must be at least 1 and at most 4"),
    ([5, 0, 2], 383, None, r"mlp_h_to_4h of adapter size 2 needs 384 values .* rows have 383"),
])
def test_nvidia_refusals(llama, row, width, max_rank, message):
    _, config, _ = llama
    with pytest.raises(InputError, match=message):
        from_nvidia(np.ones((1, width), np.float16), np.array([row], np.int32), config, max_rank=max_rank)


def test_nvidia_refuses_mismatched_or_duplicate_rows(llama):
    _, config, _ = llama
    weights = np.ones((2, 1000), np.float16)
    with pytest.raises(InputError, match="lora_config has 1 rows but lora_weights has 2"):
        from_nvidia(weights, np.array([[1, 0, 2]], np.int32), config)
    with pytest.raises(InputError, match="lora_config row 1: layer 0 q_proj is given twice"):
        from_nvidia(weights, np.array([[0, 0, 2], [1, 0, 2]], np.int32), config)
    weights[0, 5] = np.inf
    with pytest.raises(InputError, match="lora_weights row 0 .* NaN or infinite"):
        from_nvidia(weights, np.array([[1, 0, 2], [1, 1, 2]], np.int32), config)
    with pytest.raises(InputError, match="lora_config must be integers"):
        from_nvidia(weights, np.array([[1, 0, 2], [1, 1, 2]], np.float32), config)


def test_to_nvidia_reports_float16_overflow():
    huge = LoraAdapter(weights={(0, "q_proj"): (torch.ones(1, 4), torch.full((4, 1), 1e6))})
    with pytest.raises(InputError, match="layer 0 q_proj exceed float16's range"):
        to_nvidia(huge)
    assert to_nvidia(huge, np.float32)[0].max() == 1e6


# --- tools/lora_convert.py ---

def test_lora_convert_tool(llama, tmp_path, capsys):
    _, config, folder = llama
    model_dir = tmp_path / "base"
    save_tiny_checkpoint("llama3", model_dir)
    out = tmp_path / "task_7"
    assert lora_convert.main(["-i", str(folder), "-o", str(out), "--model", str(model_dir)]) == 0
    weights, rows = np.load(out / "model.lora_weights.npy"), np.load(out / "model.lora_config.npy")
    assert weights.shape == (1, 21, 768) and weights.dtype == np.float16
    assert rows.shape == (1, 21, 3) and rows.dtype == np.int32
    expected_weights, expected_rows = to_nvidia(read_peft(folder, config))
    np.testing.assert_array_equal(weights[0], expected_weights)
    np.testing.assert_array_equal(rows[0], expected_rows)
    assert from_nvidia(weights, rows, config).max_rank == 4  # what a server reads back
    assert lora_convert.main(["-i", str(folder), "-o", str(out), "--storage-type", "float32"]) == 0
    assert np.load(out / "model.lora_weights.npy").dtype == np.float32
    with pytest.raises(SystemExit):
        lora_convert.main(["-i", str(folder), "-o", str(out), "--storage-type", "bfloat16"])
    assert "numpy has no bfloat16" in capsys.readouterr().err
    assert lora_convert.main(["-i", str(tmp_path), "-o", str(out)]) == 1  # no adapter_config.json
    assert "no adapter_config.json" in capsys.readouterr().err

"""4-bit weight-only (W4A16) checkpoints on the CPU: compressed-tensors `pack-quantized` folders
made by the compressed-tensors package (tools/quantized_checkpoint.py, as llm-compressor writes
them for GPTQ and AWQ), read and computed as Hugging Face transformers' own load of the same
folder computes them, and what is not built refused by name.

How close is close: the weights dequantize exactly in fp32 ((q - zero point) * scale is a
small integer times a 16-bit scale), activations are not quantized, so ours and transformers
compute the same function and differ only by fp32 operation order: `fp32_noise_bound`. A wrong
nibble order, group, zero point or part moves logits by a large fraction of their size.
Greedy tokens are then equal unless the reference's top two are within that noise.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from ensemble.errors import ConfigError
from inflight.model.loader import load_model
from inflight.model.quantization import Int4Linear, Int4Scheme, int4, read_scheme
from tests.model import fp8_checkpoints as ckpt
from tests.model.test_fp8_checkpoints import our_logits, ref_logits
from tests.model.tolerances import fp32_noise_bound
from tools import quantized_checkpoint
from tools.checkpoints import TINY_COMMON

# (preset, group size): groups of 32 give the tiny model's projections 2 to 4 groups a row;
# None is the preset's own 128, one group a row at these widths (per channel, in effect).
VARIANTS = [("W4A16", 32), ("W4A16_ASYM", 32), ("W4A16", None)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("int4")
    out = {}
    for preset, group_size in VARIANTS:
        common = ckpt.BLOCK_COMMON if group_size is None else TINY_COMMON
        path = base / f"{preset.lower()}_{group_size}"
        out[preset, group_size] = quantized_checkpoint.save(ckpt.tiny_llama(common), path, preset,
                                                            group_size=group_size)
    return out


def assert_same_function(ours: torch.Tensor, ref: torch.Tensor, num_layers: int, width: int) -> None:
    bound = fp32_noise_bound(num_layers, width, float(ref.abs().max()))
    torch.testing.assert_close(ours, ref, rtol=0.0, atol=bound)
    for position, (a, b) in enumerate(zip(ours.argmax(-1).tolist(), ref.argmax(-1).tolist())):
        if a != b:
            top2 = ref[position].topk(2).values
            assert float(top2[0] - top2[1]) <= 2 * bound, f"position {position}: token {a}, reference {b}"


def decompressed_reference(folder, common: dict) -> torch.nn.Module:
    """The tiny model with each projection's weight as compressed-tensors' own compressor
    decompresses it from the folder's tensors (transformers 5 reinitializes packed zero points
    of an asymmetric folder on load: "size mismatch", so it cannot be the reference there)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    tensors = {}
    for path in folder.glob("*.safetensors"):
        tensors.update(load_file(path))
    group = json.loads((folder / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    model = ckpt.tiny_llama(common)
    for name, module in quantized_checkpoint.linears(model):
        state = {key[len(name) + 1:]: value for key, value in tensors.items() if key.startswith(name + ".")}
        weight = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
        module.weight.data.copy_(weight.float())
    return model


@pytest.mark.parametrize("preset, group_size", VARIANTS)
def test_pack_quantized_computes_what_compressed_tensors_decompresses(folders, preset, group_size):
    folder = folders[preset, group_size]
    common = ckpt.BLOCK_COMMON if group_size is None else TINY_COMMON
    scheme = read_scheme(folder)
    assert scheme == Int4Scheme(group_size or 128, preset == "W4A16", ("lm_head",))
    model, config = load_model(folder, torch.float32, "cpu")
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4Linear)
    assert_same_function(our_logits(model, config), ref_logits(decompressed_reference(folder, common)),
                         config.num_hidden_layers, max(config.hidden_size, config.intermediate_size))


def test_symmetric_folder_matches_transformers_own_load(folders):
    folder = folders["W4A16", 32]
    model, config = load_model(folder, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert_same_function(our_logits(model, config), ref_logits(hf), config.num_hidden_layers,
                         max(config.hidden_size, config.intermediate_size))


def test_the_weights_are_the_checkpoints_not_the_originals(folders):
    """The 4-bit rounding shows: loading is not silently the unquantized model."""
    folder = folders["W4A16", 32]
    model, config = load_model(folder, torch.float32, "cpu")
    plain = ckpt.tiny_llama()
    ours, original = our_logits(model, config), ref_logits(plain)
    assert float((ours - original).norm() / original.norm()) > 1e-3


def test_unpacking_is_compressed_tensors_own():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(-8, 8, (24, 64), dtype=torch.int8)
    zero_point = torch.randint(-8, 8, (24, 4), dtype=torch.int8)
    assert torch.equal(int4.pack(q), pack_to_int32(q, 4))
    assert torch.equal(int4.unpack(pack_to_int32(q, 4), 64), q)
    assert torch.equal(int4.unpack_rows(pack_to_int32(zero_point, 4, packed_dim=0), 24), zero_point)


def _edited(folder, tmp_path, edit_group=None, edit=None):
    shutil.copytree(folder, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    qc = config["quantization_config"]
    qc["config_groups"]["group_0"]["weights"].update(edit_group or {})
    qc.update(edit or {})
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    return tmp_path / "m"


@pytest.mark.parametrize("edit_group, message", [
    ({"num_bits": 8}, "weights.num_bits/type is (8, 'int')"),
    ({"actorder": "group"}, "weights.actorder is 'group'"),
    ({"strategy": "tensor"}, "weights.strategy is 'tensor'"),
])
def test_what_is_not_built_is_refused_by_name(folders, tmp_path, edit_group, message):
    folder = _edited(folders["W4A16", 32], tmp_path, edit_group)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(folder, torch.float32, "cpu")


def test_a_recorded_shape_that_differs_is_refused(folders, tmp_path):
    """`weight_shape` is checked: a folder whose packed rows hide another width fails at load."""
    from safetensors.torch import load_file, save_file

    folder = _edited(folders["W4A16", 32], tmp_path)
    [path] = folder.glob("*.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.down_proj.weight_shape"
    tensors[name] = torch.tensor([64, 120])
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_shape \[\(64, 120\)\] does not match"):
        load_model(folder, torch.float32, "cpu")


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_packed_qkv_and_gate_up_compute_the_separate_projections(folders, preset, monkeypatch):
    """CUDA's layout, on the CPU: q/k/v and gate/up stacked row-wise with their scales and
    (packed) zero points compute exactly what the separate projections do."""
    from inflight.model import loader

    folder = folders[preset, 32]
    separate, config = load_model(folder, torch.float32, "cpu")
    monkeypatch.setattr(loader, "packs_projections", lambda device: True)
    packed, _ = load_model(folder, torch.float32, "cpu")
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj, Int4Linear)
    attn = separate.model.layers[1].self_attn
    qkv = packed.model.layers[1].self_attn.qkv_proj
    assert torch.equal(qkv.dequantized, torch.cat([attn.q_proj.dequantized, attn.k_proj.dequantized,
                                                   attn.v_proj.dequantized]))
    assert_same_function(our_logits(packed, config), our_logits(separate, config), config.num_hidden_layers,
                         max(config.hidden_size, config.intermediate_size))


def test_fp8_at_load_of_a_4_bit_folder_is_refused(folders):
    with pytest.raises(ConfigError, match="already quantized"):
        load_model(folders["W4A16", 32], torch.float32, "cpu", quantization="fp8")

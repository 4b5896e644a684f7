"""FP8 checkpoints on the CPU: each format read from its folder, computed as its scheme says,
checked against Hugging Face's own load (compressed-tensors) or a torch-only reference
(ModelOpt, HF fp8; tests/model/fp8_checkpoints.py), and unknown formats refused by name.

How close is close: ours and the reference compute the same function (FP8 activations and
weights, fp32 arithmetic) and differ by fp32 reduction order; where that moves a value across an
e4m3 rounding boundary, that one element moves by one e4m3 step, 2^-3 of itself. A wrong scale,
block, group or part moves logits by a large fraction of their size. So logits must agree within
half an e4m3 step of their size (relative L2 distance 2^-4), and greedy tokens must agree except
where the reference's top-1/top-2 margin is within one e4m3 step of the largest logit.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from ensemble.errors import ConfigError
from inflight.model.attention import StepMetadata
from inflight.model.loader import allocate_kv_caches, load_model
from inflight.model.quantization import Fp8Linear, Fp8Scheme, fp8, read_scheme
from tests.model import fp8_checkpoints as ckpt

E4M3_STEP = 2.0 ** -3  # relative distance between neighbouring e4m3 values (3 mantissa bits)
PROMPT = [1, 17, 250, 33, 499, 8, 120, 64, 3, 77, 5, 9]


def our_logits(model, config, prompt=PROMPT) -> torch.Tensor:
    """Logits at every prompt position, through the paged cache in one step."""
    caches = allocate_kv_caches(config, 8, 16, torch.float32, "cpu")
    meta = StepMetadata.build([(0, len(prompt), list(range(8)))], 16, "cpu")
    hidden = model(torch.tensor(prompt), meta.positions, caches, model.attention_backend.build_metadata(meta))
    return model.compute_logits(hidden)


def ref_logits(hf, prompt=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0].float()


def assert_fp8_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    relative = float((ours.double() - ref.double()).norm() / ref.double().norm())
    assert relative <= E4M3_STEP / 2, f"logits differ by {relative:.3g} of their size"
    for position, (a, b) in enumerate(zip(ours.argmax(-1).tolist(), ref.argmax(-1).tolist())):
        if a != b:
            top2 = ref[position].topk(2).values
            assert float(top2[0] - top2[1]) <= E4M3_STEP * float(ref[position].abs().max()), (
                f"position {position}: token {a}, reference {b}, not a near tie")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8")
    out = {}
    for preset in ("FP8_DYNAMIC", "FP8", "FP8_BLOCK"):
        common = ckpt.BLOCK_COMMON if preset == "FP8_BLOCK" else ckpt.TINY_COMMON
        out[preset] = ckpt.save_compressed_tensors(preset, base / preset.lower(), common)
    (base / "modelopt").mkdir()
    out["modelopt"] = ckpt.save_modelopt(base / "modelopt")
    (base / "hf_fp8").mkdir()
    out["hf_fp8"] = ckpt.save_hf_fp8(base / "hf_fp8")
    return out


@pytest.mark.parametrize("preset, weights, activations", [
    ("FP8_DYNAMIC", "channel", "token"), ("FP8", "tensor", "static"), ("FP8_BLOCK", "block", "group")])
def test_compressed_tensors_matches_transformers_own_load(folders, preset, weights, activations):
    scheme = read_scheme(folders[preset])
    assert (scheme.source, scheme.weights, scheme.activations) == ("compressed-tensors", weights, activations)
    model, config = load_model(folders[preset], torch.float32, "cpu")
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[preset], dtype=torch.float32).eval()
    assert_fp8_close(our_logits(model, config), ref_logits(hf))


def test_activations_are_quantized_not_only_the_weights(folders):
    """Dequantizing the weights alone is another function (it gives other greedy tokens within
    a few steps on real models): the per-token activation rounding must show."""
    model, config = load_model(folders["FP8_DYNAMIC"], torch.float32, "cpu")
    ours = our_logits(model, config)
    for module in model.modules():
        if isinstance(module, Fp8Linear):
            module.scheme = Fp8Scheme(module.scheme.weights, "none")
    weight_only = our_logits(model, config)
    assert float((ours - weight_only).norm() / weight_only.norm()) > 1e-4


def _quantize_input(scheme: str):
    def quantize(name, x, tensors):
        return fp8.fake_quantize(x, scheme, tensors.get(f"{name}.input_scale"))
    return quantize


def test_modelopt_per_tensor_static(folders):
    scheme = read_scheme(folders["modelopt"])
    assert (scheme.source, scheme.weights, scheme.activations, scheme.kv_cache) == ("ModelOpt", "tensor", "static", True)
    model, config = load_model(folders["modelopt"], torch.float32, "cpu")  # its k/v cache scales are accepted
    reference = ckpt.hand_written_reference(folders["modelopt"], _quantize_input("static"))
    assert_fp8_close(our_logits(model, config), ref_logits(reference))


def test_modelopt_is_read_from_hf_quant_config_alone(folders, tmp_path):
    shutil.copytree(folders["modelopt"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    assert read_scheme(tmp_path / "m") == read_scheme(folders["modelopt"])


def test_hf_fine_grained_fp8_blocks(folders):
    scheme = read_scheme(folders["hf_fp8"])
    assert (scheme.source, scheme.weights, scheme.scale_suffix) == ("Hugging Face fp8", "block", "weight_scale_inv")
    model, config = load_model(folders["hf_fp8"], torch.float32, "cpu")
    reference = ckpt.hand_written_reference(folders["hf_fp8"], _quantize_input("group"))
    assert_fp8_close(our_logits(model, config), ref_logits(reference))


def test_quantization_fp8_at_load(tmp_path):
    """An unquantized checkpoint with `quantization: fp8`: per-channel weights and per-token
    activations, computed as that scheme says."""
    hf = ckpt.tiny_llama()
    hf.save_pretrained(tmp_path)
    model, config = load_model(tmp_path, torch.float32, "cpu", quantization="fp8")
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == fp8.FP8 and layer.weight_scale.shape == (64,)
    for name, module in list(hf.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            q, scale = fp8.quantize_weight_per_channel(module.weight.detach())
            weight = fp8.dequantize_weight(q, scale, "channel")
            bias = module.bias.detach() if module.bias is not None else None
            setattr(hf.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2],
                    ckpt._FakeQuantLinear(weight, bias, lambda x: fp8.fake_quantize(x, "token", None)))
    assert_fp8_close(our_logits(model, config), ref_logits(hf))
    with pytest.raises(ConfigError, match="quantization 'int4' is not supported"):
        load_model(tmp_path, torch.float32, "cpu", quantization="int4")


def test_fp8_checkpoint_tool_writes_a_folder_that_serves(tmp_path):
    """tools/quantized_checkpoint.py on a model folder: the FP8_DYNAMIC folder, with the files
    beside the weights (tokenizer, generation config) copied as they are."""
    from tools import quantized_checkpoint

    ckpt.tiny_llama().save_pretrained(tmp_path / "plain")
    (tmp_path / "plain" / "tokenizer_config.json").write_text("{}")
    assert quantized_checkpoint.main(["--model", str(tmp_path / "plain"), "--out", str(tmp_path / "fp8")]) == 0
    assert (tmp_path / "fp8" / "tokenizer_config.json").read_text() == "{}"
    scheme = read_scheme(tmp_path / "fp8")
    assert (scheme.source, scheme.weights, scheme.activations) == ("compressed-tensors", "channel", "token")
    model, _ = load_model(tmp_path / "fp8", torch.float32, "cpu")
    assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)


def test_per_token_rounding_is_compressed_tensors_own():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(7, 64) * torch.logspace(-2, 2, 7).unsqueeze(1)
    args = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    amax = x.abs().amax(dim=1, keepdim=True)
    scale, zero = calculate_qparams(-amax, amax, args)
    assert torch.equal(fp8.fake_quantize(x, "token", None), fake_quantize(x, scale, zero, args))


def test_packed_per_tensor_parts_rescale_to_the_largest_scale():
    """q/k/v (or gate/up) with their own per-tensor scales become one projection, rescaled to
    the largest scale as vLLM and TensorRT-LLM do: that part stays bit exact, the others move by
    at most one e4m3 rounding."""
    torch.manual_seed(0)
    parts = [(torch.randn(8, 16) * s).to(fp8.FP8) for s in (1.0, 3.0, 0.5)]
    scales = [torch.tensor(0.02), torch.tensor(0.05), torch.tensor(0.01)]
    merged, top = fp8.requantize_to_max(list(zip(parts, scales)))
    assert torch.equal(top, scales[1])
    exact = torch.cat([q.float() * s for q, s in zip(parts, scales)])
    got = merged.float() * top
    assert torch.equal(got[8:16], exact[8:16])
    # Half an e4m3 step of the value, or half the smallest (subnormal) step, 2^-10, of the scale.
    assert bool(((got - exact).abs() <= E4M3_STEP / 2 * exact.abs() + 2 ** -10 * top).all())


@pytest.mark.parametrize("edit, message", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"format": "marlin-24", "config_groups": {"group_0": {"format": "marlin-24", "targets": ["Linear"],
                                                            "weights": {"num_bits": 4, "type": "int"}}}},
     "format is 'marlin-24'"),
    ({"config_groups": {"group_0": {"format": "float-quantized", "targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "group",
                                                "group_size": 64}}}},
     "weights.strategy is 'group'"),
    ({"config_groups": {"group_0": {"format": "float-quantized", "targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                          "dynamic": True}}}},
     "input_activations is strategy 'tensor', dynamic True"),
    ({"config_groups": {"group_0": {"format": "float-quantized", "targets": ["Linear"],
                                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                                                "symmetric": False}}}},
     "weights.symmetric is False"),
])
def test_what_is_not_supported_is_refused_by_name(folders, tmp_path, edit, message):
    shutil.copytree(folders["FP8_DYNAMIC"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"].update(edit)
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_model(tmp_path / "m", torch.float32, "cpu")


def test_modelopt_algorithms_other_than_fp8_are_refused(folders, tmp_path):
    shutil.copytree(folders["modelopt"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = "NVFP4"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="ModelOpt checkpoint: quant_algo is 'NVFP4'"):
        read_scheme(tmp_path / "m")

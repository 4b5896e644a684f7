"""Tiny FP8 checkpoints in the formats people download, and the references to check them by.

compressed-tensors folders are made by the `compressed-tensors` package itself (the library
llm-compressor writes with): its scheme presets are applied to a tiny random Llama, the scales
are computed with its own `calculate_qparams` (static input scales from activations observed on
calibration tokens, as an observer does), and its `ModelCompressor` writes the folder. Hugging
Face transformers loads those folders itself, activation quantization included: the reference.

ModelOpt needs CUDA to quantize, and transformers has no `modelopt` method, so its folder is
written by hand from the documented names (`weight`, `weight_scale`, `input_scale`,
`self_attn.k_proj.k_scale`, `hf_quant_config.json`); likewise Hugging Face's `fp8` block format
(`weight_scale_inv`), which transformers quantizes on a GPU only. Their reference is the same
tiny model with each projection computed as `fake_quantize(x) @ dequantize(W)^T`, written here
with torch alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from tools.checkpoints import TINY_COMMON, tiny_hf_model

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The block formats need widths that are multiples of 128 (activation groups of 128 columns).
BLOCK_COMMON = {**TINY_COMMON, "hidden_size": 128, "intermediate_size": 256}
CALIBRATION = [[1, 17, 250, 33, 499, 8, 120, 64, 3, 77, 5, 9, 300, 2, 41]]


def tiny_llama(common: dict = TINY_COMMON) -> torch.nn.Module:
    if common is TINY_COMMON:
        return tiny_hf_model("llama3")
    torch.manual_seed(4321)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()


def _linears(model: torch.nn.Module):
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"]


def _input_amax(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each projection's largest input magnitude over the calibration tokens."""
    amax, hooks = {}, []
    for name, module in _linears(model):
        def hook(mod, args, name=name):
            value = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)
        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        model(torch.tensor(CALIBRATION))
    for hook in hooks:
        hook.remove()
    return amax


def save_compressed_tensors(preset: str, path: Path, common: dict = TINY_COMMON) -> Path:
    """A compressed-tensors `float-quantized` folder of the preset (FP8, FP8_DYNAMIC, FP8_BLOCK)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = tiny_llama(common)
    amax = _input_amax(model)
    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    for name, module in _linears(model):
        scheme = module.quantization_scheme
        weights, strategy = scheme.weights, str(getattr(scheme.weights.strategy, "value", scheme.weights.strategy))
        w = module.weight.detach().float()
        if strategy == "tensor":
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        elif strategy == "channel":
            low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:  # 128 x 128 blocks
            rows, cols = module.weight_scale.shape
            blocks = torch.nn.functional.pad(w, (0, cols * 128 - w.shape[1], 0, rows * 128 - w.shape[0]))
            blocks = blocks.reshape(rows, 128, cols, 128)
            low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        scale, _ = calculate_qparams(low, high, weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if hasattr(module, "input_scale") and not scheme.input_activations.dynamic:
            scale, _ = calculate_qparams(-amax[name].reshape(1), amax[name].reshape(1), scheme.input_activations)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    return path


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax().float() / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def save_modelopt(path: Path, kv_scales: bool = True) -> Path:
    """A ModelOpt FP8 folder: per-tensor weight and input scales (q/k/v's deliberately differ),
    k/v cache scales, `hf_quant_config.json` and the `config.json` form."""
    model = tiny_llama()
    amax = _input_amax(model)
    tensors = {}
    for name, param in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in amax and name.endswith(".weight"):
            q, scale = _per_tensor(param)
            tensors[name], tensors[f"{module}.weight_scale"] = q, scale
            tensors[f"{module}.input_scale"] = amax[module] / FP8_MAX
        else:
            tensors[name] = param.detach().clone()
    if kv_scales:
        for layer in range(model.config.num_hidden_layers):
            tensors[f"model.layers.{layer}.self_attn.k_proj.k_scale"] = torch.tensor(0.05)
            tensors[f"model.layers.{layer}.self_attn.v_proj.v_scale"] = torch.tensor(0.04)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "modelopt", "quant_algo": "FP8", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                                      "weights": {"dynamic": False, "num_bits": 8, "type": "float"},
                                      "targets": ["Linear"]}},
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"} if kv_scales else None,
        "producer": {"name": "modelopt", "version": "0.47.0"}}
    (path / "config.json").write_text(json.dumps(config))
    (path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_scales else None,
                         "exclude_modules": ["lm_head"]}}))
    return path


def save_hf_fp8(path: Path) -> Path:
    """Hugging Face's fine-grained FP8: 128x128 weight blocks scaled by `weight_scale_inv`."""
    model = tiny_llama(BLOCK_COMMON)
    tensors = {}
    linears = {name for name, _ in _linears(model)}
    for name, param in model.state_dict().items():
        module = name.rpartition(".")[0]
        if module in linears and name.endswith(".weight"):
            rows, cols = -(-param.shape[0] // 128), -(-param.shape[1] // 128)
            padded = torch.nn.functional.pad(param.float(), (0, cols * 128 - param.shape[1], 0, rows * 128 - param.shape[0]))
            scale = padded.reshape(rows, 128, cols, 128).abs().amax(dim=(1, 3)) / FP8_MAX
            full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:param.shape[0], :param.shape[1]]
            tensors[name] = (param.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            tensors[f"{module}.weight_scale_inv"] = scale
        else:
            tensors[name] = param.detach().clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


class _FakeQuantLinear(torch.nn.Module):
    """The reference projection: fake-quantized input times the dequantized weight, in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, quantize_input):
        super().__init__()
        self.weight, self.bias, self.quantize_input = weight, bias, quantize_input

    def forward(self, x):
        return torch.nn.functional.linear(self.quantize_input(x), self.weight, self.bias)


def hand_written_reference(path: Path, quantize_input) -> torch.nn.Module:
    """The HF model of a hand-written folder (ModelOpt, HF fp8), each projection dequantized
    from the folder's tensors and its input quantized by `quantize_input(module name, x)`."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).eval().float()
    state = {}
    for name, value in tensors.items():
        if value.dtype != FP8 and not name.endswith(("_scale", "_scale_inv")):
            state[name] = value.float()
    model.load_state_dict(state, strict=False)
    for name, module in _linears(model):
        q = tensors[f"{name}.weight"].float()
        if f"{name}.weight_scale_inv" in tensors:
            scale = tensors[f"{name}.weight_scale_inv"].float()
            weight = q * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:q.shape[0], :q.shape[1]]
        else:
            weight = q * tensors[f"{name}.weight_scale"].float()
        parent = model.get_submodule(name.rpartition(".")[0])
        bias = module.bias.detach().float() if module.bias is not None else None
        setattr(parent, name.rpartition(".")[2],
                _FakeQuantLinear(weight, bias, lambda x, name=name: quantize_input(name, x, tensors)))
    return model

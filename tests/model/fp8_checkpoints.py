"""Tiny FP8 checkpoints in the formats people download, and the references to check them by.

compressed-tensors folders are made by the `compressed-tensors` package itself (the library
llm-compressor writes with), through `tools/quantized_checkpoint.py`: its scheme presets are applied
to a tiny random Llama, the scales are computed with its own `calculate_qparams` (static input
scales from activations observed on calibration tokens, as an observer does), and its
`ModelCompressor` writes the folder. Hugging
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

from tools import quantized_checkpoint
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


def save_compressed_tensors(preset: str, path: Path, common: dict = TINY_COMMON) -> Path:
    """A compressed-tensors `float-quantized` folder of the preset (FP8, FP8_DYNAMIC, FP8_BLOCK)
    of the tiny model, written by `tools/quantized_checkpoint.py` (the compressed-tensors package)."""
    return quantized_checkpoint.save(tiny_llama(common), path, preset, CALIBRATION)


def _per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax().float() / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def save_modelopt(path: Path, kv_scales: bool = True) -> Path:
    """A ModelOpt FP8 folder: per-tensor weight and input scales (q/k/v's deliberately differ),
    k/v cache scales, `hf_quant_config.json` and the `config.json` form."""
    model = tiny_llama()
    amax = quantized_checkpoint.input_amax(model, CALIBRATION)
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
    linears = {name for name, _ in quantized_checkpoint.linears(model)}
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
    for name, module in quantized_checkpoint.linears(model):
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

"""Write a quantized checkpoint of a Hugging Face model in compressed-tensors' format (FP8
`float-quantized`, or 4-bit `pack-quantized`), with the `compressed-tensors` package (the library
llm-compressor writes with).

    python3 tools/quantized_checkpoint.py --model DIR --out DIR [--preset FP8_DYNAMIC] [--group-size N]

Presets are compressed-tensors' own: FP8_DYNAMIC (per-channel weights, dynamic per-token
activations: no calibration), FP8 (per-tensor weights, static per-tensor activations, their
scales observed on calibration text), FP8_BLOCK (128x128 weight blocks, dynamic activation
groups of 128), and the weight-only W4A16 / W4A16_ASYM (4-bit integers in groups of 128, or
`--group-size`; symmetric, or with zero points). Scales come from the package's
`calculate_qparams` (a min-max observer, llm-compressor's default: round to nearest, no GPTQ
or AWQ search, which change the values but not the format); the LM head stays unquantized, as
in llm-compressor's recipes. The tokenizer files are copied, so the folder serves as it is
(`make serve MODEL=DIR`). Needs `compressed-tensors` (in requirements-test.txt).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

PRESETS = ("FP8_DYNAMIC", "FP8", "FP8_BLOCK", "W4A16", "W4A16_ASYM")
INT4_PRESETS = ("W4A16", "W4A16_ASYM")
# A short text for the FP8 preset's static input scales when none is given.
CALIBRATION_TEXT = ("The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four "
                    "papers; the third introduced special relativity. def main():\n    return 0\n")


def linears(model: torch.nn.Module) -> list[tuple[str, torch.nn.Linear]]:
    """The projections a preset quantizes: every nn.Linear but the LM head."""
    return [(name, module) for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head"]


def input_amax(model: torch.nn.Module, batches: list[list[int]]) -> dict[str, torch.Tensor]:
    """Each projection's largest input magnitude over the calibration token batches."""
    amax, hooks = {}, []
    for name, module in linears(model):
        def hook(mod, args, name=name):
            value = args[0].detach().abs().amax().float()
            amax[name] = torch.maximum(amax.get(name, value), value)
        hooks.append(module.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in batches:
                model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    return amax


def quantize(model: torch.nn.Module, preset: str, calibration: list[list[int]] | None = None,
             group_size: int | None = None) -> None:
    """Applies `preset` to `model` in place and compresses it (its state dict becomes the
    folder's tensors). `calibration`: token batches for static input scales (FP8 only);
    `group_size`: the 4-bit presets' group (default theirs, 128)."""
    try:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import (
            QuantizationConfig,
            apply_quantization_config,
            preset_name_to_scheme,
        )
        from compressed_tensors.quantization.utils import calculate_qparams
    except ImportError as exc:
        raise SystemExit("tools/quantized_checkpoint.py needs the compressed-tensors package "
                         "(pip install -r requirements-test.txt)") from exc
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    amax = input_amax(model, calibration or []) if preset == "FP8" else {}
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        if preset not in INT4_PRESETS:
            raise ValueError(f"--group-size is for the 4-bit presets, not {preset}")
        scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for name, module in linears(model):
        scheme = module.quantization_scheme
        weights, strategy = scheme.weights, str(getattr(scheme.weights.strategy, "value", scheme.weights.strategy))
        w = module.weight.detach().float()
        if strategy == "tensor":
            low, high = w.amin().reshape(1), w.amax().reshape(1)
        elif strategy == "channel":
            low, high = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        elif strategy == "group":  # [N, K / group]
            grouped = w.unflatten(1, (-1, weights.group_size))
            low, high = grouped.amin(dim=2), grouped.amax(dim=2)
        else:  # 128 x 128 blocks
            rows, cols = module.weight_scale.shape
            blocks = torch.nn.functional.pad(w, (0, cols * 128 - w.shape[1], 0, rows * 128 - w.shape[0]))
            blocks = blocks.reshape(rows, 128, cols, 128)
            low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        scale, zero_point = calculate_qparams(low, high, weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        if not weights.symmetric:
            module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
        if hasattr(module, "input_scale") and not scheme.input_activations.dynamic:
            if name not in amax:
                raise ValueError(f"preset {preset} has static input scales: calibration tokens needed")
            scale, _ = calculate_qparams(-amax[name].reshape(1), amax[name].reshape(1), scheme.input_activations)
            module.input_scale.data.copy_(scale.reshape(module.input_scale.shape))
    quantization_format = "pack-quantized" if preset in INT4_PRESETS else "float-quantized"
    model.ct_compressor = ModelCompressor.from_pretrained_model(model, quantization_format=quantization_format)
    model.ct_compressor.compress_model(model)


def save(model: torch.nn.Module, path: Path, preset: str, calibration: list[list[int]] | None = None,
         group_size: int | None = None) -> Path:
    """`quantize`, then the folder written (weights, config.json with its quantization_config)."""
    quantize(model, preset, calibration, group_size)
    model.save_pretrained(path)
    model.ct_compressor.update_config(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--preset", default="FP8_DYNAMIC", choices=PRESETS)
    parser.add_argument("--group-size", type=int, default=None,
                        help="the 4-bit presets' group of input columns per scale (default 128)")
    args = parser.parse_args(argv)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
    calibration = None
    if args.preset == "FP8":
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        calibration = [tokenizer(CALIBRATION_TEXT)["input_ids"]]
    args.out.mkdir(parents=True, exist_ok=True)
    save(model, args.out, args.preset, calibration, args.group_size)
    for item in args.model.iterdir():  # the tokenizer and generation config, as they are
        if item.is_file() and not item.name.endswith((".safetensors", ".bin")) and item.name != "config.json" \
                and not item.name.endswith(".index.json"):
            shutil.copy2(item, args.out / item.name)
    print(f"wrote {args.preset} checkpoint of {args.model} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

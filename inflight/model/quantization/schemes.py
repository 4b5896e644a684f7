"""Which quantization a checkpoint folder holds, read from its files and checked; no torch.

Three FP8 formats are read (`read_scheme`), each into one `Fp8Scheme`:
- compressed-tensors (`config.json` `quantization_config.quant_method: compressed-tensors`,
  what llm-compressor writes): format `float-quantized`, weights FP8 per tensor, per channel or
  in 128x128 blocks; activations static per tensor (`input_scale`), dynamic per token, or
  dynamic in groups of 128 (with block weights); an `ignore` list; `kv_cache_scheme`.
- NVIDIA ModelOpt (`quant_method: modelopt` in `config.json`, or `hf_quant_config.json`):
  `quant_algo: FP8`, per-tensor static weights and activations, `exclude_modules`,
  `kv_cache_quant_algo` (with `k_scale`/`v_scale` tensors).
- Hugging Face's fine-grained FP8 (`quant_method: fp8`): 128x128 weight blocks stored as
  `weight_scale_inv`, dynamic activations in groups of 128, `modules_to_not_convert`.
Anything else, an unknown method, format, field value or a second, different scheme, is a
`ConfigError` naming the format and the field: a checkpoint is never half understood.

`Fp8Scheme.for_load` is the same scheme made at load from an unquantized checkpoint
(`quantization: fp8`): per-channel weights, dynamic per-token activations.

One integer format is read into an `Int4Scheme`: compressed-tensors `pack-quantized` with 4-bit
integer weights in groups (or per channel), symmetric or with zero points, and activations left
in the model's dtype (W4A16: what llm-compressor writes for GPTQ and AWQ).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ensemble.errors import ConfigError

BLOCK = (128, 128)  # weight blocks (rows, columns) and activation groups of the block formats


@dataclass(frozen=True)
class Fp8Scheme:
    """An FP8 (e4m3) linear-layer scheme.

    `weights`: `tensor` | `channel` | `block` (scales [], [out], [out/128, in/128]).
    `activations`: `static` (one scale per tensor, from the checkpoint's `input_scale`),
    `token` (one per token, computed on the fly), `group` (per token and 128 columns, on the
    fly), or `none` (weight-only: activations stay in the model's dtype).
    `ignore`: module names (or `re:` patterns) left unquantized; `kv_cache`: the checkpoint
    holds FP8 KV-cache scales; `source`: the format, for messages; `scale_suffix`: the name of
    the weight-scale tensors (`weight_scale`, or `weight_scale_inv` in HF's format).
    """

    weights: str
    activations: str
    ignore: tuple[str, ...] = ()
    kv_cache: bool = False
    source: str = "compressed-tensors"
    scale_suffix: str = "weight_scale"
    quantized_on_load: bool = False  # the checkpoint is unquantized: weights are quantized at load

    def __post_init__(self):
        if self.weights not in ("tensor", "channel", "block"):
            raise ConfigError(f"{self.source}: weights strategy '{self.weights}' is not supported "
                              "(tensor, channel or block)")
        if self.activations not in ("static", "token", "group", "none"):
            raise ConfigError(f"{self.source}: input_activations '{self.activations}' is not supported")
        if (self.activations == "group") != (self.weights == "block") and self.activations != "none":
            raise ConfigError(f"{self.source}: activations in groups of 128 go with 128x128 weight "
                              f"blocks (got weights {self.weights}, activations {self.activations})")

    @classmethod
    def for_load(cls) -> Fp8Scheme:
        return cls("channel", "token", ignore=("lm_head",), source="quantization: fp8",
                   quantized_on_load=True)

    def is_ignored(self, module_name: str) -> bool:
        return _is_ignored(self.ignore, module_name)


@dataclass(frozen=True)
class Int4Scheme:
    """Weight-only 4-bit integer weights (W4A16): w = (q - zero_point) * scale, q in [-8, 7],
    one scale (and zero point, when not `symmetric`) per `group_size` input columns of each
    output row (`group_size` None: one per row). Activations stay in the model's dtype."""

    group_size: int | None
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    kv_cache: bool = False
    source: str = "compressed-tensors"
    activations: str = "none"
    quantized_on_load: bool = False

    def __post_init__(self):
        if self.group_size is not None and (self.group_size <= 0 or self.group_size % 8):
            raise ConfigError(f"{self.source}: group_size {self.group_size} is not supported "
                              "(a positive multiple of 8)")

    def is_ignored(self, module_name: str) -> bool:
        return _is_ignored(self.ignore, module_name)


Scheme = Fp8Scheme | Int4Scheme


def _is_ignored(ignore: tuple[str, ...], module_name: str) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.fullmatch(entry[3:], module_name):
                return True
        elif module_name == entry or module_name.endswith("." + entry):
            return True
    return False


def read_scheme(model_dir: str | Path) -> Scheme | None:
    """The checkpoint's quantization, or None for an unquantized one. ConfigError for one that
    is not supported, naming the format and the field."""
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    qc = config.get("quantization_config")
    if qc is None and (model_dir / "hf_quant_config.json").is_file():
        qc = {"quant_method": "modelopt", **_modelopt_file(model_dir / "hf_quant_config.json")}
    if qc is None:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    if method == "modelopt":
        return _modelopt(qc)
    if method == "fp8":
        return _hf_fp8(qc)
    raise ConfigError(f"checkpoint quantization_config.quant_method '{qc.get('quant_method')}' is not "
                      "supported; this engine reads compressed-tensors (FP8 float-quantized, "
                      "4-bit pack-quantized), NVIDIA ModelOpt (quant_algo FP8) and Hugging Face (quant_method fp8)")


def _modelopt_file(path: Path) -> dict:
    data = json.loads(path.read_text())
    quantization = data.get("quantization", data)
    return {"quant_algo": quantization.get("quant_algo"),
            "kv_cache_quant_algo": quantization.get("kv_cache_quant_algo"),
            "ignore": quantization.get("exclude_modules") or []}


def _require(ok: bool, source: str, field: str, value, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{source} checkpoint: {field} is {value!r}; this engine supports {expected}")


def _float8(args: dict, source: str, field: str) -> None:
    _require(args.get("num_bits") == 8 and args.get("type") == "float", source, f"{field}.num_bits/type",
             (args.get("num_bits"), args.get("type")), "8-bit float (FP8 e4m3)")
    _require(args.get("symmetric", True) is True, source, f"{field}.symmetric", args.get("symmetric"),
             "symmetric quantization")


def _compressed_tensors(qc: dict) -> Scheme:
    source = "compressed-tensors"
    groups = qc.get("config_groups") or {}
    _require(bool(groups), source, "quantization_config.config_groups", groups, "one quantization group")
    formats = set()
    for name, group in groups.items():
        if isinstance(group, str):
            raise ConfigError(f"{source} checkpoint: config_groups.{name} is the preset name '{group}'; "
                              "write the scheme out (llm-compressor does)")
        fmt = group.get("format") or qc.get("format")
        _require(fmt in ("float-quantized", "pack-quantized"), source, f"config_groups.{name}.format", fmt,
                 "float-quantized (FP8) or pack-quantized (4-bit integer weights)")
        formats.add(fmt)
    _require(len(formats) == 1, source, "config_groups formats", sorted(formats), "one format for every Linear")
    if formats == {"pack-quantized"}:
        return _ct_pack_quantized(qc, groups)
    schemes = set()
    for name, group in groups.items():
        _require(_targets_linear(group.get("targets")), source, f"config_groups.{name}.targets",
                 group.get("targets"), "Linear")
        weights = group.get("weights") or {}
        _float8(weights, source, f"config_groups.{name}.weights")
        _require(not weights.get("dynamic"), source, f"config_groups.{name}.weights.dynamic",
                 weights.get("dynamic"), "static weight scales")
        strategy = weights.get("strategy")
        if strategy == "block":
            _require(list(weights.get("block_structure") or []) == list(BLOCK), source,
                     f"config_groups.{name}.weights.block_structure", weights.get("block_structure"), "[128, 128]")
        _require(strategy in ("tensor", "channel", "block"), source, f"config_groups.{name}.weights.strategy",
                 strategy, "tensor, channel or block")
        schemes.add((strategy, _ct_activations(group.get("input_activations"), source, name)))
        _require(group.get("output_activations") is None, source, f"config_groups.{name}.output_activations",
                 group.get("output_activations"), "none")
    _require(len(schemes) == 1, source, "quantization_config.config_groups", sorted(schemes),
             "one scheme for every Linear")
    [(weights, activations)] = schemes
    return Fp8Scheme(weights, activations, tuple(qc.get("ignore") or ()), _ct_kv_cache(qc, source), source)


def _ct_kv_cache(qc: dict, source: str) -> bool:
    """Whether the checkpoint holds FP8 KV-cache scales (`kv_cache_scheme`), checked."""
    kv = qc.get("kv_cache_scheme")
    if kv is None:
        return False
    _float8(kv, source, "kv_cache_scheme")
    _require(kv.get("strategy", "tensor") == "tensor" and not kv.get("dynamic"), source,
             "kv_cache_scheme.strategy", kv.get("strategy"), "static per-tensor KV scales")
    return True


def _ct_pack_quantized(qc: dict, groups: dict) -> Int4Scheme:
    source = "compressed-tensors"
    schemes = set()
    for name, group in groups.items():
        field = f"config_groups.{name}"
        _require(_targets_linear(group.get("targets")), source, f"{field}.targets", group.get("targets"), "Linear")
        weights = group.get("weights") or {}
        _require(weights.get("num_bits") == 4 and weights.get("type") == "int", source,
                 f"{field}.weights.num_bits/type", (weights.get("num_bits"), weights.get("type")),
                 "4-bit integers (W4A16)")
        strategy = weights.get("strategy")
        _require(strategy in ("group", "channel"), source, f"{field}.weights.strategy", strategy, "group or channel")
        _require(not weights.get("dynamic"), source, f"{field}.weights.dynamic", weights.get("dynamic"),
                 "static weight scales")
        actorder = weights.get("actorder")
        _require(actorder in (None, "weight", "static"), source, f"{field}.weights.actorder", actorder,
                 "none, weight or static (group order, which compressed-tensors deprecates, stores a "
                 "g_idx permutation that is not built)")
        _require(group.get("input_activations") is None and group.get("output_activations") is None, source,
                 f"{field}.input_activations", group.get("input_activations"),
                 "none (weight-only: activations in the model's dtype)")
        group_size = weights.get("group_size") if strategy == "group" else None
        schemes.add((group_size, weights.get("symmetric", True) is not False))
    _require(len(schemes) == 1, source, "quantization_config.config_groups", sorted(schemes, key=str),
             "one scheme for every Linear")
    [(group_size, symmetric)] = schemes
    return Int4Scheme(group_size, symmetric, tuple(qc.get("ignore") or ()), _ct_kv_cache(qc, source), source)


def _targets_linear(targets) -> bool:
    return isinstance(targets, list) and len(targets) > 0 and all(
        t in ("Linear", "re:.*Linear") or t.startswith("re:") and "proj" in t for t in targets)


def _ct_activations(args: dict | None, source: str, name: str) -> str:
    if args is None:
        return "none"
    field = f"config_groups.{name}.input_activations"
    _float8(args, source, field)
    strategy, dynamic = args.get("strategy"), args.get("dynamic")
    if strategy == "tensor" and dynamic is False:
        return "static"
    if strategy == "token" and dynamic is True:
        return "token"
    if strategy == "group" and dynamic is True and args.get("group_size") == BLOCK[1]:
        return "group"
    raise ConfigError(f"{source} checkpoint: {field} is strategy {strategy!r}, dynamic {dynamic!r}"
                      f"{', group_size ' + str(args.get('group_size')) if strategy == 'group' else ''}; "
                      "this engine supports static per-tensor, dynamic per-token, or dynamic groups of 128")


def _modelopt(qc: dict) -> Fp8Scheme:
    source = "ModelOpt"
    algo = qc.get("quant_algo")
    _require(algo == "FP8", source, "quant_algo", algo, "FP8 (per-tensor weights and activations)")
    kv = qc.get("kv_cache_quant_algo")
    if kv is None and isinstance(qc.get("kv_cache_scheme"), dict):
        kv = "FP8" if qc["kv_cache_scheme"].get("num_bits") == 8 else qc["kv_cache_scheme"]
    _require(kv in (None, "FP8"), source, "kv_cache_quant_algo", kv, "FP8 or none")
    ignore = qc.get("ignore") or qc.get("exclude_modules") or []
    return Fp8Scheme("tensor", "static", tuple(ignore), kv == "FP8", source)


def _hf_fp8(qc: dict) -> Fp8Scheme:
    source = "Hugging Face fp8"
    _require(qc.get("activation_scheme", "dynamic") == "dynamic", source, "activation_scheme",
             qc.get("activation_scheme"), "dynamic")
    _require(list(qc.get("weight_block_size") or []) == list(BLOCK), source, "weight_block_size",
             qc.get("weight_block_size"), "[128, 128]")
    return Fp8Scheme("block", "group", tuple(qc.get("modules_to_not_convert") or ()), False, source,
                     scale_suffix="weight_scale_inv")

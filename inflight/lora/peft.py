"""Hugging Face PEFT adapter folders (`adapter_config.json` + `adapter_model.safetensors`, or the
legacy `adapter_model.bin`) read into a `LoraAdapter`.

Only plain LoRA on the seven Llama projections is built, so every option that changes the math
(DoRA, biases, per-module ranks or alphas, extra trained modules, ...) is refused when the folder
is read, naming the key: serving such an adapter as plain LoRA would silently give other outputs.
Options that only matter for training (dropout, initialisation, `layers_to_transform`, which
just decides which layers have tensors) are accepted.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from ensemble.errors import InputError
from inflight.lora.adapter import MODULES, LoraAdapter
from inflight.model.config import ModelConfig

# `...layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}[.{adapter name}].weight`. PEFT strips the
# adapter name when it saves, but a raw `state_dict()` of a PeftModel keeps it (`.default`).
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight")
_GROUP = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Fused projections some other architectures (Phi-3) have; a Llama checkpoint never does.
_FUSED = ("qkv_proj", "gate_up_proj")
# PEFT's own defaults when adapter_config.json omits them (LoraConfig's field defaults).
_DEFAULT_R, _DEFAULT_ALPHA = 8, 8

# Config keys that change the forward pass and are not built, with the value that is fine.
# (velora_config, loftq/eva/corda/lora_ga configs and init_lora_weights only change training.)
_MUST_BE_OFF = ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern", "lora_bias",
                "fan_in_fan_out", "trainable_token_indices", "layer_replication", "target_parameters",
                "alora_invocation_tokens", "use_qalora", "use_bdlora", "kasa_config",
                "monteclora_config", "arrow_config")


def _unsupported_module(name: str, where: str) -> InputError:
    if name in _FUSED:
        return InputError(f"{where}: fused module {name} is not supported (a Llama-family checkpoint "
                          f"has separate projections; LoRA applies to {', '.join(MODULES)})")
    return InputError(f"{where}: module {name} is not supported (LoRA applies to {', '.join(MODULES)}, "
                      "not to embeddings or the LM head)")


def check_peft_config(cfg: dict[str, Any]) -> float:
    """Raises InputError for any `adapter_config.json` setting this server cannot apply;
    returns the scale folded into B (lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA)."""
    peft_type = cfg.get("peft_type", "LORA")  # a hand-written config may omit it: keys tell
    if str(peft_type).upper() != "LORA":
        raise InputError(f"adapter_config.json peft_type: {peft_type!r} is not supported (only LORA)")
    for key in _MUST_BE_OFF:
        if cfg.get(key):  # False, None, [] and {} are all "off"
            raise InputError(f"adapter_config.json {key}: {cfg[key]!r} is not supported "
                             "(it changes the adapter's math and only plain LoRA is served)")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise InputError(f"adapter_config.json bias: {bias!r} is not supported (only \"none\")")
    targets = cfg.get("target_modules")
    # A string is a regex or "all-linear": what it matched shows in the tensor keys, checked there.
    if isinstance(targets, (list, tuple)):
        for target in targets:
            name = str(target).rsplit(".", 1)[-1]
            if name not in MODULES:
                raise _unsupported_module(name, "adapter_config.json target_modules")
    r, alpha = cfg.get("r", _DEFAULT_R), cfg.get("lora_alpha", _DEFAULT_ALPHA)
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InputError(f"adapter_config.json r: {r!r} is not a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise InputError(f"adapter_config.json lora_alpha: {alpha!r} is not a number")
    # The formula as PEFT's LoraLayer.update_layer computes it, in Python floats.
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors, preferring safetensors (as PEFT does) over the legacy pickle."""
    safetensors_file, bin_file = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    if not safetensors_file.is_file() and not bin_file.is_file():
        raise InputError(f"LoRA adapter folder {folder} has neither adapter_model.safetensors nor "
                         "adapter_model.bin")
    try:
        if safetensors_file.is_file():
            from safetensors.torch import load_file

            tensors = load_file(safetensors_file, device="cpu")
        else:
            # weights_only: an adapter folder is user input, and a full unpickle runs arbitrary code.
            tensors = torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as exc:  # each format has its own errors; all mean "a broken upload"
        raise InputError(f"could not read the LoRA weights in {folder}: {exc}") from exc
    if not isinstance(tensors, dict):
        raise InputError(f"{bin_file} does not hold a dict of tensors")
    return tensors


_Pairs = dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]]


def _pair_tensors(tensors: dict[str, torch.Tensor]) -> _Pairs:
    """(layer, module) -> {"A"|"B": (key, tensor)}; refuses every key that is not a LoRA factor of
    a supported projection (embeddings, LM head, DoRA magnitudes, biases, fused projections)."""
    pairs: _Pairs = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            if any(name in key for name in _FUSED):
                raise _unsupported_module(next(n for n in _FUSED if n in key), f"adapter tensor {key}")
            raise InputError(f"adapter tensor {key} is not supported: only lora_A / lora_B weights of "
                             f"{', '.join(MODULES)} in the decoder layers are served")
        layer, group, module, factor = int(match[1]), match[2], match[3], match[4]
        if module not in MODULES:
            raise _unsupported_module(module, f"adapter tensor {key}")
        if _GROUP[module] != group:
            raise InputError(f"adapter tensor {key}: a Llama-family model has no {module} under {group}")
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or not tensor.is_floating_point():
            got = (f"{tensor.dtype} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor)
                   else type(tensor).__name__)
            raise InputError(f"adapter tensor {key}: expected a 2-D float matrix, got {got}")
        entry = pairs.setdefault((layer, module), {})
        if factor in entry:
            raise InputError(f"adapter tensor {key} duplicates {entry[factor][0]}")
        entry[factor] = (key, tensor)
    return pairs


def read_peft(folder: str | Path, config: ModelConfig | None, dtype: torch.dtype = torch.float32,
              max_rank: int | None = None) -> LoraAdapter:
    """Reads the PEFT adapter in `folder`, B scaled, both factors cast to `dtype`.

    `config` is the base model's: every entry is then checked against its shapes and layer count
    (and `max_rank`). It is required so that a caller skips that check only on purpose, with
    `None` (the converter tool, which may not have the base model at hand): then only A and B of
    each module are checked against each other and against adapter_config.json's rank.
    Raises InputError, naming the key, for anything this server would not apply exactly.
    """
    folder = Path(folder)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise InputError(f"LoRA adapter folder {folder} has no adapter_config.json")
    try:
        cfg = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise InputError(f"{config_file} is not a JSON object")
    scale = check_peft_config(cfg)
    rank = cfg.get("r", _DEFAULT_R)
    weights = {}
    pairs = _pair_tensors(_load_tensors(folder))
    for layer, module in sorted(pairs, key=lambda key: (key[0], MODULES.index(key[1]))):
        entry = pairs[(layer, module)]
        for factor, other in (("A", "B"), ("B", "A")):
            if other not in entry:
                raise InputError(f"adapter tensor {entry[factor][0]} has no matching lora_{other}")
        (a_key, a), (b_key, b) = entry["A"], entry["B"]
        # rank_pattern is refused, so every module has the config's rank; a mismatch means the
        # scale computed from `r` would be wrong for this module.
        if a.shape[0] != rank or b.shape[1] != rank:
            raise InputError(f"adapter tensors {a_key} {list(a.shape)} and {b_key} {list(b.shape)}: "
                             f"expected rank {rank} (adapter_config.json r)")
        # Scale in float32 whatever the file's dtype, then round once to the serving dtype.
        weights[(layer, module)] = (a.to(torch.float32).to(dtype).contiguous(),
                                    (b.to(torch.float32) * scale).to(dtype).contiguous())
    if not weights:  # e.g. a target_modules regex that matched nothing: serving it is a no-op
        raise InputError(f"LoRA adapter folder {folder} holds no lora_A / lora_B weights")
    adapter = LoraAdapter(weights=weights)
    if config is not None:
        adapter.check(config, max_rank)
    return adapter

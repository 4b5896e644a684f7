"""Read `config.pbtxt` parameters (NVIDIA's keys), shared by every Triton adapter."""

from __future__ import annotations

from typing import Any

from ensemble.errors import ConfigError

_TRUE = {"true", "1", "yes", "y", "t", "on"}
_FALSE = {"false", "0", "no", "n", "f", "off"}


def read_parameters(model_config: dict[str, Any]) -> dict[str, str]:
    """Parameters that carry a value. Empty strings and unfilled `${...}` templates count as
    unset, so an optional key left out by fill_template keeps its default."""
    values = {}
    for key, entry in (model_config.get("parameters") or {}).items():
        value = str(entry.get("string_value", "")).strip()
        if value and not (value.startswith("${") and value.endswith("}")):
            values[key] = value
    return values


def get_bool(params: dict[str, str], key: str, default: bool) -> bool:
    if key not in params:
        return default
    value = params[key].lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"parameter {key} must be true or false, got '{params[key]}'")


def _get_number(params: dict[str, str], key: str, default, cast, kind: str):
    if key not in params:
        return default
    try:
        return cast(params[key])
    except ValueError:
        raise ConfigError(f"parameter {key} must be {kind}, got '{params[key]}'") from None


def get_int(params: dict[str, str], key: str, default: int | None) -> int | None:
    return _get_number(params, key, default, int, "an integer")


def get_float(params: dict[str, str], key: str, default: float | None) -> float | None:
    return _get_number(params, key, default, float, "a number")


def queue_size(model_config: dict[str, Any]) -> int | None:
    """Triton's dynamic-batching queue limit; 0 (Triton's "unlimited") maps to None."""
    policy = (model_config.get("dynamic_batching") or {}).get("default_queue_policy") or {}
    size = int(policy.get("max_queue_size", 0) or 0)
    return size or None

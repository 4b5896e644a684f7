"""Errors shared by every package: bad client input, and bad configuration.

The Triton adapters turn an `InputError` into a per-request `TritonError` (HTTP 400) and keep
serving the rest of the batch; a `ConfigError` stops a model from loading with one sentence
that names the parameter. Anything else is a server fault.
"""

from __future__ import annotations


class InputError(ValueError):
    """A request's input is unusable; the message is safe to return to the client."""


class ConfigError(ValueError):
    """A configuration value breaks a documented rule."""


def check(ok: bool, message: str, error: type[ValueError] = ConfigError) -> None:
    """Raise `error(message)` unless `ok`: the one-line rules that config and request types
    check at construction."""
    if not ok:
        raise error(message)

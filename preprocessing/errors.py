"""Errors raised for bad client input, as opposed to bugs or broken model folders.

The Triton adapters turn an `InputError` into a per-request `TritonError` (HTTP 400) and keep
serving the rest of the batch; anything else is a server fault.
"""

from __future__ import annotations


class InputError(ValueError):
    """A request's input is unusable; the message is safe to return to the client."""

"""Integer arithmetic on the engine's sizes (blocks, tiles, shards), in one place; no torch."""

from __future__ import annotations


def cdiv(a, b):
    """ceil(a / b) for non-negative ints, or elementwise for integer numpy arrays."""
    return -(-a // b)

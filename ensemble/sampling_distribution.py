"""The distribution a request samples from, from a position's raw logits (numpy, no torch): the
BLS model turns a draft model's logits into the `draft_logits` its sampling drew from, and the
engine's rejection rule reads the target's the same way (`inflight.sampling.speculative`)."""

from __future__ import annotations

import numpy as np


def sampling_distribution(logits: np.ndarray, temperature: float, top_k: int = 0,
                          top_p: float = 1.0) -> np.ndarray:
    """[n, V] raw logits -> [n, V] float32 probabilities: softmax at `temperature` over the tokens
    inside top-k (0: off) and top-p (1: off; the smallest set of likeliest tokens whose mass
    reaches top_p), the others 0. A temperature of 0 (greedy) puts all mass on the argmax."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature <= 0.0:  # one-hot rows (not np.eye: that is V x V, 65 GB at 128k tokens)
        probs = np.zeros(logits.shape, dtype=np.float32)
        np.put_along_axis(probs, logits.argmax(-1)[:, None], 1.0, -1)
        return probs
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = np.sort(scaled, axis=-1)[:, -top_k][:, None]
        scaled = np.where(scaled < kth, -np.inf, scaled)
    scaled = scaled - scaled.max(-1, keepdims=True)
    probs = np.exp(scaled)
    probs /= probs.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, -1)
        before = np.cumsum(ranked, -1) - ranked  # the mass of the likelier tokens
        ranked = np.where(before >= top_p, 0.0, ranked)
        probs = np.zeros_like(probs)
        np.put_along_axis(probs, order, ranked, -1)
        probs /= probs.sum(-1, keepdims=True)
    return probs.astype(np.float32)


def as_logits(probs: np.ndarray) -> np.ndarray:
    """Probabilities -> logits whose plain softmax gives them back (log, -inf where 0): what
    TensorRT-LLM's `draft_logits` must be, since it takes their softmax without temperature."""
    with np.errstate(divide="ignore"):
        return np.log(probs).astype(np.float32)

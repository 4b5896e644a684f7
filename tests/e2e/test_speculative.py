"""Speculative decoding end to end: the shared server's repository was built with a draft model
(`--draft_model`, the default model itself, so every draft is right). The BLS model's
draft-target flow (`num_draft_tokens`), streamed and not, with and without `use_draft_logits`,
gives the text of the same request without drafts: the default model runs in fp32 on the CPU,
greedy, where drafts change no token."""

from __future__ import annotations

import numpy as np
import pytest

from tests.e2e.test_nvidia_compat import stream_once, text_inputs

pytestmark = pytest.mark.e2e


def _bls_text(server, stream: bool, num_draft_tokens: int, use_draft_logits: bool = False) -> str:
    values = text_inputs(max_tokens=24, stream=np.array([[stream]]),
                         exclude_input_in_output=np.array([[True]]), top_k=np.array([[1]], np.int32),
                         use_draft_logits=np.array([[use_draft_logits]]),
                         num_draft_tokens=np.array([[num_draft_tokens]], np.int32))
    results, errors, _ = stream_once(server, values, "tensorrt_llm_bls", ["text_output"])
    assert not errors, errors
    return "".join(r.as_numpy("text_output")[0].decode("utf-8") for r in results)


def test_draft_target_through_the_bls_model_gives_the_targets_text(server):
    want = _bls_text(server, False, 0)
    assert want
    assert _bls_text(server, False, 4) == want
    assert _bls_text(server, True, 4) == want
    assert _bls_text(server, True, 4, use_draft_logits=True) == want  # draft_logits cross the wire

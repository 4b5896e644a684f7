"""The templates' tensor sections are the contract's, rendered; a stale template fails here."""

from __future__ import annotations

from ensemble.io_contract import ENSEMBLE, MODELS, TENSORRT_LLM, TENSORRT_LLM_BLS
from tools import render_templates


def test_every_template_is_rendered_from_the_contract():
    assert render_templates.main(["--check"]) == 0


def test_the_ensemble_routes_every_input_and_output():
    steps = render_templates.ensemble_steps()
    for spec in ENSEMBLE.inputs:
        assert f'value: "{spec.name}"' in steps, spec.name
    for spec in ENSEMBLE.outputs:
        assert f'value: "{spec.name}"' in steps, spec.name


def test_bls_and_ensemble_share_the_text_interface():
    assert [t.name for t in ENSEMBLE.outputs] == [t.name for t in TENSORRT_LLM_BLS.outputs]
    assert {t.name for t in ENSEMBLE.inputs} < {t.name for t in TENSORRT_LLM_BLS.inputs}
    assert set(MODELS) == {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"}


def test_nvidia_required_inputs_are_the_only_required_ones():
    assert TENSORRT_LLM.required_inputs == ("input_lengths", "request_output_len")
    # NVIDIA requires text_input (QUERY) too; ours takes input_ids in its place, and
    # preprocessing refuses a request with neither (tests/e2e/test_control_tokens.py).
    assert ENSEMBLE.required_inputs == ("max_tokens",)
    assert MODELS["preprocessing"].required_inputs == ("REQUEST_OUTPUT_LEN",)

"""The templates' tensor sections are the contract's, rendered; a stale template fails here."""

from __future__ import annotations

import pytest

from ensemble.io_contract import ENSEMBLE, MODELS, TENSORRT_LLM, TENSORRT_LLM_BLS
from ensemble.wiring import DIRECT_TEXT_INPUTS, text_input_route
from tools import render_templates


def test_every_template_is_rendered_from_the_contract():
    assert render_templates.main(["--check"]) == 0


@pytest.mark.parametrize("direct", [False, True])
def test_the_ensemble_routes_every_input_and_output(direct):
    steps = render_templates.ensemble_steps(direct)
    for spec in ENSEMBLE.inputs:
        assert f'value: "{spec.name}"' in steps, spec.name
    for spec in ENSEMBLE.outputs:
        assert f'value: "{spec.name}"' in steps, spec.name
    assert ('model_name: "preprocessing"' in steps) is not direct


def test_the_direct_path_feeds_only_engine_inputs_with_the_ensembles_types():
    """Each text input the direct ensemble sends tensorrt_llm exists there, with the dtype of the
    ensemble input it carries (Triton refuses to load a mismatched ensemble)."""
    routes = dict(line.split(' value: "') for line in render_templates.ensemble_steps(True).splitlines()
                  if "input_map" in line and 'model_name: "postprocessing"' not in line)
    for pre_name, engine_name in DIRECT_TEXT_INPUTS.items():
        engine = TENSORRT_LLM.input(engine_name)
        ensemble = next(t for t in ENSEMBLE.inputs if text_input_route(t.name) == ("preprocessing", pre_name))
        assert engine.dtype == ensemble.dtype, (pre_name, engine_name)
        assert engine.optional or not ensemble.optional, engine_name  # required only if always sent
        assert any(engine_name in key for key in routes), engine_name


def test_bls_and_ensemble_share_the_text_interface():
    assert [t.name for t in ENSEMBLE.outputs] == [t.name for t in TENSORRT_LLM_BLS.outputs]
    assert {t.name for t in ENSEMBLE.inputs} < {t.name for t in TENSORRT_LLM_BLS.inputs}
    assert set(MODELS) == {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"}


def test_nvidia_required_inputs_are_the_only_required_ones():
    # NVIDIA requires input_lengths too; the direct path fills it from the text (DirectText), and
    # a request with input_ids and without it is refused by name (inflight.serving.convert).
    assert TENSORRT_LLM.required_inputs == ("request_output_len",)
    # NVIDIA requires text_input (QUERY) too; ours takes input_ids in its place, and
    # preprocessing refuses a request with neither (tests/e2e/test_control_tokens.py).
    assert ENSEMBLE.required_inputs == ("max_tokens",)
    assert MODELS["preprocessing"].required_inputs == ("REQUEST_OUTPUT_LEN",)

"""Which ensembles the engine model unloads when a drain begins (inflight/serving/drain.py): read
from the repository's config.pbtxt files by a scan of their text format, no protobuf."""

from __future__ import annotations

from pathlib import Path

from inflight.serving.drain import dependent_ensembles, ensemble_steps

TEMPLATES = Path(__file__).resolve().parents[2] / "model_repository"

STEPS_AS_MESSAGES = """
# platform: "python"   (a comment: neither it nor the brackets in it count) } ] {
name: 'custom_ensemble'
platform: "ensemble"
max_batch_size: 8
input [ { name: "text_input" data_type: TYPE_STRING dims: [ 1 ] } ]
ensemble_scheduling {
  step {
    model_name: "preprocessing"
    model_version: -1
    input_map { key: "QUERY" value: "text_input" }
    output_map { key: "INPUT_ID", value: "_IDS" }
  }
  step { model_name: "tensorrt_llm" model_version: -1 input_map { key: "input_ids" value: "_IDS" } };
}
"""
PYTHON_MODEL = """
name: "tensorrt_llm_bls"
backend: "python"
# platform: "ensemble"
parameters: { key: "tensorrt_llm_model_name" value: { string_value: "tensorrt_llm" } }
parameters: { key: "model_name" value: { string_value: "tensorrt_llm" } }
"""


def test_the_ensemble_template_names_its_three_steps_and_no_other_template_is_an_ensemble():
    assert ensemble_steps((TEMPLATES / "ensemble" / "config.pbtxt").read_text()) == (
        "ensemble", ["preprocessing", "tensorrt_llm", "postprocessing"])
    for model in ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls"):
        assert ensemble_steps((TEMPLATES / model / "config.pbtxt").read_text()) is None, model


def test_steps_written_as_repeated_messages_quotes_and_comments():
    assert ensemble_steps(STEPS_AS_MESSAGES) == ("custom_ensemble", ["preprocessing", "tensorrt_llm"])
    assert ensemble_steps(PYTHON_MODEL) is None
    assert ensemble_steps('platform: "ensemble"') == ("", [])
    assert ensemble_steps('platform: "ensemble" ensemble_scheduling { step [ { model_name: "a" }') is None
    assert ensemble_steps('platform: "ensemble" input [ { name: "x" } }') is None


def test_dependent_ensembles_are_the_ensembles_with_a_step_running_the_model(tmp_path):
    configs = {
        "custom_ensemble": STEPS_AS_MESSAGES,
        "unnamed": 'platform: "ensemble"\nensemble_scheduling { step [ { model_name: "tensorrt_llm" } ] }',
        "other_ensemble": 'name: "other_ensemble" platform: "ensemble" '
                          'ensemble_scheduling { step [ { model_name: "tensorrt_llm_draft" } ] }',
        "broken": 'platform: "ensemble" ensemble_scheduling { step [ { model_name: "tensorrt_llm" }',
        "tensorrt_llm_bls": PYTHON_MODEL,
        "tensorrt_llm": 'name: "tensorrt_llm" backend: "python"',
    }
    for model, text in configs.items():
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.pbtxt").write_text(text)
    (tmp_path / "no_config").mkdir()
    assert dependent_ensembles(tmp_path / "tensorrt_llm", "tensorrt_llm") == ["custom_ensemble", "unnamed"]
    draft_dir = str(tmp_path / "tensorrt_llm_draft")  # a str works as well as a Path
    assert dependent_ensembles(draft_dir, "tensorrt_llm_draft") == ["other_ensemble"]
    assert dependent_ensembles(tmp_path / "tensorrt_llm", "postprocessing") == []

"""tools/build_repository.py renders every template into a config Triton parses (needs
tritonclient's protobuf, which the serving tier has; starts no server)."""

from __future__ import annotations

import pytest

from ensemble.io_contract import MODELS
from tools import build_repository

pytestmark = pytest.mark.e2e


def test_builder_fills_every_template_and_parses_as_model_config(tmp_path, smollm2_dir):
    args = build_repository.parse_args(["--model", str(smollm2_dir), "--out", str(tmp_path / "repo")])
    out = build_repository.build(tmp_path / "repo", build_repository.values_from_args(args))
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    for model in MODELS:
        text = (out / model / "config.pbtxt").read_text()
        assert "${" not in text
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
        assert config.name == model
    assert (out / "ensemble" / "1").is_dir()


def test_builder_names_a_placeholder_left_unfilled(tmp_path, smollm2_dir):
    args = build_repository.parse_args(["--model", str(smollm2_dir), "--out", str(tmp_path / "repo")])
    values = build_repository.values_from_args(args)
    del values["decoupled_mode"]
    with pytest.raises(build_repository.BuildError, match=r"\$\{decoupled_mode\}"):
        build_repository.build(tmp_path / "repo", values)

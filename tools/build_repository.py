"""Build a ready-to-serve Triton model repository from `model_repository/` in one call.

    python tools/build_repository.py --model path/to/hf_dir --out build/repository [--key value ...]

Copies the five models, fills every `config.pbtxt` template from one consistent set of values
(the defaults below, overridden by `--<key> value` or `--set k1:v1,k2:v2` in fill_template's
syntax), refuses to write a config that still holds a placeholder (and names it), and checks
each result against `ensemble.io_contract` by parsing it as Triton's ModelConfig protobuf.

`--lora_modules "name=PEFT_DIR name2=PEFT_DIR2"` serves HF PEFT adapters by name: each is
checked against the model and converted into `tensorrt_llm/1/lora/<task id>/` (task ids 1, 2,
... in the order given; NVIDIA's prefetch layout), which becomes `lora_prefetch_dir`, and
`lora_modules.json` there maps each name to its task id for the OpenAI frontend.

`--tokenize_in preprocessing` (the default) keeps NVIDIA's three ensemble steps (the
templates'); `tensorrt_llm` wires the ensemble's text straight to the engine model, which
tokenizes it itself: a first token at low load skips a Python hop, but under heavy streaming
load the tokenizing competes with that model's response thread (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
from pathlib import Path

from ensemble.io_contract import MODELS
from ensemble.limits import DEFAULT_MAX_GUIDE_BYTES, DEFAULT_MAX_NUM_WORDS
from inflight.serving.params import template_defaults
from tools.fill_template import fill, split_pairs
from tools.render_templates import render

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "model_repository"
PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")

# Every template variable with its default. tokenizer_dir and engine_dir default to --model.
DEFAULTS = {
    "triton_backend": "python",
    "triton_max_batch_size": "64",
    "decoupled_mode": "true",
    "max_queue_delay_microseconds": "0",
    "max_queue_size": "0",
    # Tokenizing is a first token's first stage; one instance queued requests for tens of
    # milliseconds at concurrency 64 on an H100 host (bench/serving_trace.py). Instances are
    # processes, so as many as the cores allow: 1 below 8 cores, 2 at 8, 4 from 16.
    "preprocessing_instance_count": str(max(1, min(4, (os.cpu_count() or 1) // 4))),
    "postprocessing_instance_count": "1",
    "add_special_tokens": "true",
    "skip_special_tokens": "true",
    "trust_remote_code": "false",
    "executor_backend": "builtin",
    # The engine in a process of its own, off the python stub's interpreter lock (builtin only).
    "engine_process": "true",
    "batching_strategy": "inflight_fused_batching",
    # Beam search costs nothing until a request asks for it (its blocks and rows are reserved
    # then), so `make serve` takes NVIDIA's clients' `--beam-width 2` as it is.
    "max_beam_width": "4",
    "max_num_sequences": "64",
    # auto: 8192 (TensorRT-LLM's), 256 on the CPU with chunked context (inflight/platform.py).
    "max_num_tokens": "auto",
    "max_seq_len": "",
    # Per-request limits (prompt tokens, max_tokens); unset: only the model's context bounds them.
    "max_input_len": "",
    "max_output_len": "",
    # The prompt's UTF-8 bytes, checked before tokenizing; unset: 32 bytes a token of max_input_len.
    "max_input_bytes": "",
    # Words per stop_words / bad_words / embedding_bias_words list, and a guided-decoding
    # guide's bytes (ensemble/limits.py).
    "max_num_words": str(DEFAULT_MAX_NUM_WORDS),
    "max_guide_bytes": str(DEFAULT_MAX_GUIDE_BYTES),
    # true: special-token strings in text_input become control tokens (a client that renders
    # a chat template itself and sends its markers as text, e.g. Triton's OpenAI frontend).
    "parse_special_tokens": "false",
    "dtype": "auto",
    "device": "auto",
    # fp8: an unquantized checkpoint's projections quantized to FP8 at load (vLLM's name).
    "quantization": "",
    "batch_scheduler_policy": "guaranteed_no_evict",
    "enable_chunked_context": "true",
    "max_tokens_in_paged_kv_cache": "",
    "kv_cache_free_gpu_mem_fraction": "0.9",
    "kv_cache_cpu_mem_bytes": "",
    "tokens_per_block": "32",
    # fp8: K/V stored in e4m3, twice the tokens in the same memory (vLLM's name).
    "kv_cache_dtype": "auto",
    "enable_kv_cache_reuse": "false",
    # NVIDIA's default: the non-streamed output_ids/text start with the prompt.
    "exclude_input_in_output": "false",
    "normalize_log_probs": "true",
    "cancellation_check_period_ms": "100",
    "stats_check_period_ms": "100",
    "iter_stats_max_iterations": "1000",
    # Guided decoding (json, json_schema, regex, ebnf_grammar guides) with the tokenizer in
    # tokenizer_dir. NVIDIA leaves it off; "" turns it off (saves building xgrammar's view of
    # the vocabulary at load). xgrammar_tokenizer_info_path: NVIDIA's C++ model's alternative.
    "guided_decoding_backend": "xgrammar",
    "xgrammar_tokenizer_info_path": "",
    # attention_backend, cuda_graph_mode, cuda_graph_cache_size, ...: declared once, with the
    # engine's defaults, in inflight/serving/params.py KNOBS.
    **template_defaults(),
    # Dtypes NVIDIA's templates leave to fill_template; DTYPE_CHOICES lists what we accept.
    "logits_datatype": "TYPE_FP32",
    "encoder_input_features_data_type": "TYPE_FP16",
    "prompt_embedding_table_data_type": "TYPE_FP16",
    # Tensor parallelism: one rank (gpu_device_ids empty: GPUs 0..N-1; num_nodes: NVIDIA's key).
    "tensor_parallel_size": "1",
    "gpu_device_ids": "",
    "num_nodes": "",
    # NVIDIA's keys for features this engine lacks; unset (see the templates).
    "encoder_engine_dir": "",
    "max_attention_window_size": "",
    "sink_token_length": "",
    "cross_kv_cache_fraction": "",
    "kv_cache_host_memory_bytes": "",
    "kv_cache_onboard_blocks": "",
    "enable_trt_overlap": "",
    "request_stats_max_iterations": "",
    "participant_ids": "",
    "lora_cache_optimal_adapter_size": "",
    "lora_cache_max_adapter_size": "",
    "lora_cache_gpu_memory_fraction": "",
    "lora_cache_host_memory_bytes": "",
    "lora_prefetch_dir": "",
    # Ours: speculative decoding (TensorRT-LLM's LLM API names where it has them); see docs/speculative.md.
    "speculative_decoding_type": "",
    "speculative_model_dir": "",
    "max_draft_len": "",
    "max_matching_ngram_size": "",
    "min_matching_ngram_size": "",
    "max_draft_batch_size": "",
    "decoding_mode": "",
    "lookahead_window_size": "",
    "lookahead_ngram_size": "",
    "lookahead_verification_set_size": "",
    "medusa_choices": "",
    "eagle_choices": "",
    "gpu_weights_percent": "",
    "speculative_decoding_fast_logits": "",
    "multimodal_model_path": "",
    "max_num_images": "",
    # tensorrt_llm_bls (NVIDIA's keys and defaults).
    "bls_instance_count": "1",
    "accumulate_tokens": "false",
    "tensorrt_llm_model_name": "tensorrt_llm",
    "tensorrt_llm_draft_model_name": "",
    "multimodal_encoders_name": "",
    # Ours: HF PEFT adapters served by name, "name=PEFT_DIR ..." (see the module docstring).
    "lora_modules": "",
    # Ours: a draft model (a HF folder with the same tokenizer) served as tensorrt_llm_draft, for
    # the BLS model's num_draft_tokens; its share of the free GPU memory for its KV cache.
    "draft_model": "",
    "draft_kv_cache_free_gpu_mem_fraction": "0.1",
    # Ours: which model of the ensemble tokenizes. preprocessing: NVIDIA's three steps.
    # tensorrt_llm: the ensemble sends it the text (two steps). Measured on an H100 host
    # (docs/performance.md, 2026-11-28): a first token 0.9 ms sooner at concurrency 1, but at
    # 256 streams tensorrt_llm's execute 7x slower (the tokenizing beside its busy response
    # thread), in one run +34 ms to the first token and 5 % fewer tokens/s. Either way the
    # ensemble's tensors, and every model called alone, are NVIDIA's.
    "tokenize_in": "preprocessing",
}
TOKENIZE_IN = ("tensorrt_llm", "preprocessing")

# The engine computes logits in fp32 and returns them so; the other two feed inputs that the
# engine refuses anyway (see the README), so any float type NVIDIA offers is fine.
DTYPE_CHOICES = {
    "logits_datatype": ("TYPE_FP32",),
    "encoder_input_features_data_type": ("TYPE_FP16", "TYPE_BF16", "TYPE_FP32"),
    "prompt_embedding_table_data_type": ("TYPE_FP16", "TYPE_BF16", "TYPE_FP32"),
}


class BuildError(RuntimeError):
    pass


def check_values(values: dict[str, str]) -> None:
    if values.get("tokenize_in", "preprocessing") not in TOKENIZE_IN:
        raise BuildError(f"tokenize_in must be {' or '.join(TOKENIZE_IN)}, got '{values['tokenize_in']}'")
    for key, choices in DTYPE_CHOICES.items():
        if values.get(key) not in choices:
            raise BuildError(f"{key} must be {' or '.join(choices)}, got '{values.get(key)}'")


def check_config(text: str, model: str, path: Path, values: dict[str, str]) -> None:
    """Parse as Triton's ModelConfig and compare its tensors with the I/O contract: names,
    dtypes, dims, optionality, reshape and ragged batching."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise BuildError(f"{path}: not a valid Triton model config: {exc}") from None
    contract = MODELS[model]
    for kind, declared, expected in (("input", config.input, contract.inputs),
                                     ("output", config.output, contract.outputs)):
        is_input = kind == "input"
        got = {t.name: (model_config_pb2.DataType.Name(t.data_type), tuple(t.dims),
                        is_input and t.optional, t.HasField("reshape"), is_input and t.allow_ragged_batch)
               for t in declared}
        want = {t.name: (values[t.dtype_var] if t.dtype_var else t.dtype, t.dims,
                         is_input and t.optional, t.reshape_scalar, t.allow_ragged_batch)
                for t in expected}
        if got != want:
            diff = sorted(set(got.items()) ^ set(want.items()))
            raise BuildError(f"{path}: {kind}s differ from ensemble/io_contract.py: {diff}")


def build(out: Path, values: dict[str, str], force: bool = False) -> Path:
    check_values(values)
    if out.exists():
        if not force and any(out.iterdir()):
            raise BuildError(f"{out} exists and is not empty; pass --force to replace it")
        shutil.rmtree(out)
    shutil.copytree(TEMPLATE_DIR, out, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    if values.get("lora_modules"):
        values = dict(values, lora_prefetch_dir=str(add_lora_modules(out, values["lora_modules"],
                                                                        Path(values["engine_dir"]))))
    if values.get("draft_model"):
        values = dict(values, tensorrt_llm_draft_model_name=DRAFT_MODEL_NAME)
        add_draft_model(out, values)
    for model in MODELS:
        path = out / model / "config.pbtxt"
        text = path.read_text()
        if model == "ensemble" and values.get("tokenize_in", "preprocessing") == "tensorrt_llm":
            text = render(text, model, direct=True)
        text = fill(text, values, strict=False)
        left = sorted(set(PLACEHOLDER.findall(text)))
        if left:
            raise BuildError(f"{path}: no value for {', '.join('${' + v + '}' for v in left)}; "
                             f"pass --{left[0]} VALUE")
        check_config(text, model, path, values)
        path.write_text(text)
    return out


LORA_DIR = Path("tensorrt_llm", "1", "lora")
DRAFT_MODEL_NAME = "tensorrt_llm_draft"


def add_draft_model(out: Path, values: dict[str, str]) -> None:
    """`--draft_model DIR`: a second engine model, tensorrt_llm's config over DIR, which the BLS
    model's draft-target flow calls (docs/speculative.md). It takes a small share of the free GPU
    memory for its KV cache (the target, loaded first or not, keeps most of it), and neither
    speculates itself nor serves adapters."""
    model_dir = Path(values["draft_model"])
    if not (model_dir / "config.json").is_file():
        raise BuildError(f"--draft_model {model_dir} is not a Hugging Face model folder (no config.json)")
    draft = out / DRAFT_MODEL_NAME
    shutil.copytree(out / "tensorrt_llm", draft)
    path = draft / "config.pbtxt"
    draft_values = dict(values, engine_dir=str(model_dir.resolve()), speculative_decoding_type="",
                        kv_cache_free_gpu_mem_fraction=values["draft_kv_cache_free_gpu_mem_fraction"],
                        lora_prefetch_dir="", max_loras="")
    text = fill(path.read_text(), draft_values, strict=False)
    text = text.replace('name: "tensorrt_llm"', f'name: "{DRAFT_MODEL_NAME}"', 1)
    check_config(text, "tensorrt_llm", path, draft_values)
    path.write_text(text)


LORA_NAMES_FILE = "lora_modules.json"  # {name: task id}, read by openai_frontend


def add_lora_modules(out: Path, spec: str, model_dir: Path) -> Path:
    """Converts each `name=PEFT_DIR` of `spec` into `out/LORA_DIR/<task id>/`; returns that folder."""
    from ensemble.errors import InputError
    from tools.lora_convert import convert

    names: dict[str, int] = {}
    folder = (out / LORA_DIR).resolve()
    for task_id, item in enumerate(spec.split(), start=1):
        name, _, path = item.partition("=")
        if not name or not path:
            raise BuildError(f"--lora_modules takes name=PEFT_DIR items, got '{item}'")
        if name in names:
            raise BuildError(f"--lora_modules names '{name}' twice")
        try:  # float32: the server casts to its own dtype, so the adapter is rounded once
            convert(Path(path), folder / str(task_id), "float32", model_dir)
        except (OSError, InputError) as exc:
            raise BuildError(f"LoRA module '{name}' ({path}): {exc}") from None
        names[name] = task_id
    (folder / LORA_NAMES_FILE).write_text(json.dumps(names, indent=1) + "\n")
    return folder


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    parser.add_argument("--out", required=True, type=Path, help="where to write the repository")
    parser.add_argument("--tokenizer_dir", help="default: --model")
    parser.add_argument("--force", action="store_true", help="replace --out if it exists")
    parser.add_argument("--set", default="", help='more values as "k1:v1,k2:v2" (fill_template syntax)')
    for key, default in DEFAULTS.items():
        parser.add_argument(f"--{key}", default=default, help=f"default: {default or '(unset)'}")
    return parser.parse_args(argv)


def values_from_args(args) -> dict[str, str]:
    model = str(args.model.resolve())
    values = {key: str(getattr(args, key)) for key in DEFAULTS}
    values.update(engine_dir=model, tokenizer_dir=str(Path(args.tokenizer_dir).resolve()) if args.tokenizer_dir else model)
    values.update(split_pairs(args.set) if args.set else {})
    return values


def main(argv=None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").is_file():
        print(f"error: {args.model} is not a Hugging Face model folder (no config.json)", file=sys.stderr)
        return 1
    try:
        out = build(args.out, values_from_args(args), args.force)
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"model repository written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

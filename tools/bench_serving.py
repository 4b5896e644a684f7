"""Streaming through Triton vs the engine in process: the same load, ratios from one run.

    python tools/bench_serving.py                        # CPU, the default model, c = 8, 32
    python tools/bench_serving.py --model DIR --device cuda --dtype bfloat16 \\
        --concurrency 1 16 64 256 --perf-analyzer perf_analyzer

A real tritonserver serves the model behind the ensemble (tools/build_repository.py defaults,
plus --set values); perf_analyzer drives it over gRPC streaming, with `stream` true (tokens as
they come) and false (one response), at each concurrency. In the same run the engine is driven
in this process with the same prompts (about --prompt-tokens tokens, identical ids), the same
--output-tokens (greedy, end id off) and the same configuration (read back from the filled
config.pbtxt). Per level the three paths run back to back (in process first), `--repeat` times;
the table prints output tok/s, TTFT p50 and ITL p50 (tools/serving_load.py says how) and each
path's ratio to in process. On a shared machine compare the ratios, and repeat for a range.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tools"))

import serving_load  # noqa: E402

DEFAULT_MODEL = REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct"


def engine_parameters(repo: Path) -> dict[str, str]:
    """The tensorrt_llm model's parameters as the server reads them."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse((repo / "tensorrt_llm" / "config.pbtxt").read_text(),
                               model_config_pb2.ModelConfig())
    return {k: v.string_value for k, v in config.parameters.items() if v.string_value != ""}


def in_process_engine(params: dict[str, str]):
    from inflight.engine import LLMEngine
    from inflight.serving.params import executor_config

    config = executor_config(params)
    make = getattr(LLMEngine, "from_dir", None)
    return make(params["gpt_model_path"], config) if make else LLMEngine(params["gpt_model_path"], config)


def free_engine(engine) -> None:
    del engine
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def perf_analyzer_binary(given: str | None) -> str:
    if given:
        return given
    import perf_analyzer_env

    return str(perf_analyzer_env.ensure())


def measure(args, server, params, texts, ids, work_dir: Path, binary: str) -> list:
    """Every level once: in process, Triton streaming, Triton non-streaming."""
    inputs = {stream: serving_load.perf_analyzer_inputs(work_dir / f"inputs_{stream}.json", texts,
                                                        args.output_tokens, stream)
              for stream in (True, False)}
    levels = []
    for c in args.concurrency:
        num = c * args.rounds
        engine = in_process_engine(params)
        serving_load.run_in_process(engine, ids, min(c, 4), min(c, 4), 4)  # warm-up
        levels.append(serving_load.run_in_process(engine, ids, c, num, args.output_tokens))
        free_engine(engine)
        for stream, name in ((True, "Triton streaming"), (False, "Triton non-streaming")):
            if not stream and args.skip_non_streaming:
                continue
            levels.append(serving_load.run_perf_analyzer(
                binary, server.grpc_url, inputs[stream], c, max(c, 1) * args.rounds // 3 or c,
                args.output_tokens, name, work_dir))
        report(levels[-3 if not args.skip_non_streaming else -2:])
    return levels


def report(levels: list) -> None:
    base = {lv.concurrency: lv for lv in levels if lv.path == "in process"}
    for lv in levels:
        ref = base.get(lv.concurrency)
        ratio = ""
        if ref is not None and lv is not ref:
            ratio = f"  tok/s {lv.tok_per_s / ref.tok_per_s:5.3f}x"
            if "non-streaming" not in lv.path:
                ratio += (f"  TTFT {lv.ttft_p50_ms - ref.ttft_p50_ms:+7.1f} ms"
                          f"  ITL {lv.itl_p50_ms / ref.itl_p50_ms:5.3f}x")
        latency = ("" if "non-streaming" in lv.path else
                   f"  TTFT p50 {lv.ttft_p50_ms:8.1f} ms  ITL p50 {lv.itl_p50_ms:7.2f} ms")
        print(f"  c={lv.concurrency:<4} {lv.path:<21} {lv.num_requests:>4} req  "
              f"{lv.tok_per_s:9.1f} tok/s{latency}{ratio}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokenizer-dir", help="default: --model")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3, help="requests per level = concurrency x rounds")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--perf-analyzer", help="the binary (default: tools/perf_analyzer_env.py's)")
    parser.add_argument("--skip-non-streaming", action="store_true")
    parser.add_argument("--set", default="", help="more repository values, k1:v1,k2:v2")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from fill_template import split_pairs
    from tests.e2e.server import running_server

    model = Path(args.model).resolve()
    values = {"device": args.device, "dtype": args.dtype,
              "max_num_sequences": max(args.concurrency), "triton_max_batch_size": max(64, *args.concurrency),
              # both engines live at once on a GPU: each takes a share of the free memory
              "kv_cache_free_gpu_mem_fraction": 0.3, **split_pairs(args.set)}
    if args.tokenizer_dir:
        values["tokenizer_dir"] = str(Path(args.tokenizer_dir).resolve())
    texts, ids = serving_load.build_prompts(args.tokenizer_dir or str(model), 64, args.prompt_tokens)
    print(f"{len(ids)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, "
          f"{args.output_tokens} tokens out; load average {os.getloadavg()[0]:.2f}", flush=True)
    binary = perf_analyzer_binary(args.perf_analyzer)
    runs = []
    with contextlib.ExitStack() as stack:
        work_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-serving-")))
        server = stack.enter_context(running_server(model, work_dir, **values))
        params = engine_parameters(work_dir / "repo")
        for i in range(args.repeat):
            print(f"run {i + 1} of {args.repeat}", flush=True)
            runs.append(measure(args, server, params, texts, ids, work_dir, binary))
    print(f"\nsummary (load average {os.getloadavg()[0]:.2f})")
    for i, levels in enumerate(runs):
        print(f"run {i + 1}")
        report(levels)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""lm-evaluation-harness against this server: one multiple-choice task scored by lm-eval's
`local-completions` model (our OpenAI frontend in front of a real tritonserver: token-id prompts,
`echo`, `logprobs: 1`, as lm-eval sends them) and by its `hf` model (transformers, fp32) on the
same checkpoint. The accuracies must be equal, and every request's log likelihood within the
fp32 noise of the logits it sums.

    python3 checks/lm_eval_parity.py [--model DIR] [--limit N]

The task is `checks/data/lm_eval_tiny_mc.jsonl` (20 four-way questions), as lm-eval's
`multiple_choice` output type: each choice's log likelihood after "Question: ...\\nAnswer:".

lm-eval runs in a virtual environment of its own (`.cache/lm-eval-venv`, made on first use from
the package index pip is configured with): its dependencies (datasets, pandas 3) need numpy 2,
which Triton 2.51's python stub cannot take (requirements.txt pins numpy 1.26.4 in .venv). torch
and transformers come from .venv through a .pth file, so lm-eval's `hf` side computes with the
libraries the reference tests use. Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".cache" / "models" / "smollm2-135m-instruct"
TASK_DATA = REPO / "checks" / "data" / "lm_eval_tiny_mc.jsonl"
VENV = REPO / ".cache" / "lm-eval-venv"
LM_EVAL = "lm-eval[api]==0.4.13"  # [api]: local-completions needs tenacity, aiohttp
TASK = "inflight_tiny_mc"
U = 2.0 ** -24  # fp32 unit roundoff
EPS = 2.0 ** -23  # fp32 machine epsilon (what tests/model/numerics.py's roundings use)


def lm_eval_python() -> Path:
    """The lm-eval venv's python, made (and lm-eval installed) if missing."""
    python = VENV / "bin" / "python"
    if not (VENV / "lm-eval-installed").exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        # torch and transformers from .venv, after the venv's own packages (numpy 2, pandas 3);
        # written first, so pip sees them installed and does not fetch its own torch.
        site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        (Path(site) / "inflight_venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", LM_EVAL], check=True)
        (VENV / "lm-eval-installed").write_text(LM_EVAL + "\n")
    return python


def write_task(folder: Path) -> None:
    (folder / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {TASK_DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")


def run_lm_eval(python: Path, model: str, model_args: str, task_dir: Path, out: Path, limit: int) -> dict:
    """lm_eval's per-request log likelihoods, {(doc id, choice): (log likelihood, is greedy)},
    and its accuracy."""
    subprocess.run([str(python), "-m", "lm_eval", "--model", model, "--model_args", model_args,
                    "--tasks", TASK, "--include_path", str(task_dir), "--limit", str(limit),
                    "--output_path", str(out), "--log_samples", "--batch_size", "1"], check=True)
    [samples] = list(out.rglob(f"samples_{TASK}_*.jsonl"))
    [results] = [p for p in out.rglob("results_*.json")]
    requests = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for choice, resp in enumerate(sample["resps"]):
            log_likelihood, greedy = resp[0]
            requests[sample["doc_id"], choice] = (float(log_likelihood), bool(greedy))
    acc = json.loads(results.read_text())["results"][TASK]["acc,none"]
    return {"acc": acc, "requests": requests}


def noise_bound(model_dir: Path, limit: int) -> tuple[float, int]:
    """A log likelihood's fp32 noise per token, and the largest continuation length: each
    token's log prob moves by at most twice its logits' error (tests/model/tolerances.py's
    bound at the largest |logit| over the task's prompts) plus its log_softmax's rounding."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    magnitude, longest = 0.0, 1
    for line in TASK_DATA.read_text().splitlines()[:limit]:
        doc = json.loads(line)
        for choice in doc["choices"]:
            ids = tokenizer(f"Question: {doc['question']}\nAnswer: {choice}")["input_ids"]
            with torch.no_grad():
                magnitude = max(magnitude, float(hf(torch.tensor([ids])).logits.abs().max()))
            longest = max(longest, len(tokenizer(f" {choice}", add_special_tokens=False)["input_ids"]))
    config = hf.config
    # tests/model/tolerances.py's fp32_noise_bound (two fp32 evaluations of the same network:
    # 64 (L + 1) sqrt(width) u of the logits' size), twice for a log_softmax entry, plus that
    # entry's own rounding (tests/model/numerics.py's log_softmax_noise, which it bounds).
    logits_noise = 64 * (config.num_hidden_layers + 1) * config.hidden_size ** 0.5 * U * magnitude
    log_softmax_rounding = 2 * (config.vocab_size ** 0.5 * EPS + 2 * EPS * magnitude)
    return 2 * logits_noise + log_softmax_rounding, longest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--keep", type=Path, help="keep lm-eval's outputs (samples, results) here")
    args = parser.parse_args(argv)
    from tools import serve
    from tools.local_server import free_ports, running_server

    python = lm_eval_python()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or Path(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        write_task(tmp)
        hf = run_lm_eval(python, "hf", f"pretrained={args.model},dtype=float32", tmp, tmp / "hf", args.limit)
        with running_server(args.model, tmp / "server") as server:
            [port] = free_ports(1)
            frontend = serve.start(serve.frontend_command(server.grpc_url, "127.0.0.1", port, []))
            try:
                serve.wait_http_ok(frontend, f"http://127.0.0.1:{port}/health/ready", 120, "the OpenAI frontend")
                ours = run_lm_eval(python, "local-completions",
                                   f"model=ensemble,base_url=http://127.0.0.1:{port}/v1/completions,"
                                   f"tokenizer={args.model},tokenizer_backend=huggingface,max_retries=1",
                                   tmp, tmp / "ours", args.limit)
            finally:
                serve.stop(frontend, timeout_s=15)
    per_token, longest = noise_bound(args.model, args.limit)
    worst = max(abs(ours["requests"][key][0] - value[0]) for key, value in hf["requests"].items())
    bound = per_token * longest
    greedy_same = sum(ours["requests"][key][1] == value[1] for key, value in hf["requests"].items())
    print(f"accuracy: local-completions {ours['acc']:.4f}, hf {hf['acc']:.4f}")
    print(f"log likelihoods: {len(hf['requests'])} requests, largest difference {worst:.3g} "
          f"(bound {bound:.3g}: {per_token:.3g} a token x {longest} tokens); is_greedy equal in "
          f"{greedy_same} of {len(hf['requests'])}")
    failed = not math.isclose(ours["acc"], hf["acc"]) or worst > bound
    print("RESULT lm-eval parity:", "FAILED" if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

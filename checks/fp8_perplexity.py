"""FP8's accuracy on a real model: perplexity of the default model with its weights as shipped,
as an FP8_DYNAMIC checkpoint (compressed-tensors, made here by tools/quantized_checkpoint.py), with
`quantization: fp8` at load, and with an FP8 KV cache (`kv_cache_dtype: fp8`), on a fixed
English text that ships with every Python.

    python3 checks/fp8_perplexity.py [--model DIR] [--tokens 20480] [--window 1024] [--hf] [--int4-group 64]

The text is CPython's pydoc topics (`pydoc_data.topics`, the reference manual's sections),
joined in sorted-key order; the first --tokens tokens are cut into windows of --window tokens,
each scored on its own (no context carried across), and the perplexity is exp of the mean
negative log-likelihood of every predicted token. Every model runs through the engine's own
loader and forward on the CPU in fp32: FP8 weights dequantized, activations quantized per token
on the fly, as the checkpoint's scheme says (tests/model/test_fp8_checkpoints.py checks that
arithmetic against Hugging Face's own load). Prints each perplexity and FP8's relative change;
the target is at most +2 %. Exit status 1 when a change exceeds it. With --int4-group, a
W4A16 checkpoint's change is printed too (4-bit weights rounded to nearest, no GPTQ/AWQ search:
a floor, with no target).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from inflight.model.attention import StepMetadata
from inflight.model.loader import allocate_kv_caches, load_model
from tools import quantized_checkpoint

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"
BLOCK_SIZE = 16
TARGET_CHANGE = 0.02  # FP8's
W4A16 = "W4A16 checkpoint (round to nearest), groups of"


def text_tokens(tokenizer, num_tokens: int) -> list[int]:
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < num_tokens:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than --tokens {num_tokens}")
    return ids[:num_tokens]


def perplexity(folder: Path, ids: list[int], window: int, quantization: str | None = None,
               kv_dtype: torch.dtype = torch.float32) -> float:
    model, config = load_model(folder, torch.float32, "cpu", quantization=quantization)
    caches = allocate_kv_caches(config, -(-window // BLOCK_SIZE), BLOCK_SIZE, kv_dtype, "cpu")
    total_nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            meta = StepMetadata.build([(0, len(chunk), list(range(-(-len(chunk) // BLOCK_SIZE))))],
                                      BLOCK_SIZE, "cpu", input_ids=chunk)
            hidden = model(meta.input_ids, meta.positions, caches, model.attention_backend.build_metadata(meta))
            logits = model.compute_logits(hidden)[:-1].float()  # [len - 1, vocab]
            targets = torch.tensor(chunk[1:])
            total_nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
            count += len(chunk) - 1
    return math.exp(total_nll / count)


def hf_perplexity(folder: Path, ids: list[int], window: int) -> float:
    """The same measure through Hugging Face transformers' own load of the folder (it
    decompresses compressed-tensors FP8 and quantizes activations as the scheme says)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    total_nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, window):
            chunk = ids[start:start + window]
            logits = model(torch.tensor([chunk])).logits[0, :-1].float()
            total_nll += float(torch.nn.functional.cross_entropy(logits, torch.tensor(chunk[1:]), reduction="sum"))
            count += len(chunk) - 1
    return math.exp(total_nll / count)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=20480)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--int4-group", type=int, default=0, metavar="G",
                        help="also a W4A16 checkpoint (round to nearest) in groups of G; no target")
    parser.add_argument("--hf", action="store_true",
                        help="also measure the shipped and FP8_DYNAMIC folders through transformers")
    args = parser.parse_args(argv)
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    ids = text_tokens(tokenizer, args.tokens)
    print(f"{args.model.name}: {len(ids)} tokens of pydoc_data.topics in windows of {args.window}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        fp8_dir = Path(tmp) / "fp8_dynamic"
        quantized_checkpoint.main(["--model", str(args.model), "--out", str(fp8_dir), "--preset", "FP8_DYNAMIC"])
        fp8_kv = torch.float8_e4m3fn
        runs = [("as shipped", args.model, None, torch.float32),
                ("FP8_DYNAMIC checkpoint", fp8_dir, None, torch.float32),
                ("quantization: fp8 at load", args.model, "fp8", torch.float32),
                ("kv_cache_dtype: fp8 (scales 1.0)", args.model, None, fp8_kv),
                ("FP8_DYNAMIC checkpoint and kv_cache_dtype: fp8", fp8_dir, None, fp8_kv)]
        if args.int4_group:
            int4_dir = Path(tmp) / "w4a16"
            quantized_checkpoint.main(["--model", str(args.model), "--out", str(int4_dir), "--preset", "W4A16",
                                       "--group-size", str(args.int4_group)])
            runs.append((f"{W4A16} {args.int4_group}", int4_dir, None, torch.float32))
        for name, folder, quantization, kv_dtype in runs:
            start = time.perf_counter()
            results[name] = perplexity(folder, ids, args.window, quantization, kv_dtype)
            print(f"{name}: perplexity {results[name]:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
        if args.hf:
            for name, folder in (("as shipped", args.model), ("FP8_DYNAMIC checkpoint", fp8_dir)):
                print(f"{name}, transformers: perplexity {hf_perplexity(folder, ids, args.window):.4f}", flush=True)
    base = results["as shipped"]
    failed = False
    for name, value in results.items():
        if name == "as shipped":
            continue
        change = value / base - 1
        if name.startswith(W4A16):  # 4 bits rounded to nearest: reported, no target
            print(f"RESULT {name}: {100 * change:+.2f} % perplexity")
            continue
        failed |= change > TARGET_CHANGE
        print(f"RESULT {name}: {100 * change:+.2f} % perplexity (target <= +{100 * TARGET_CHANGE:.0f} %)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

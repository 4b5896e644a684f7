#!/usr/bin/env python3
"""The ensemble's direct path tokenizes inside the tensorrt_llm stub, whose response thread is
busy under load: how long one request's preprocessing (`DirectText.resolve`) takes alone and
beside a thread running Python, with the tokenizer called as `preprocessing.control_tokens`
calls it and, for comparison, through `tokenizer.encode` (whose Rust `encode_batch` lets go of
the interpreter lock, and then waits a switch interval to take it back).

    python bench/tokenizer_gil.py [--model DIR] [--tokens 140]

CPU only; prints median and worst milliseconds per request.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from preprocessing import control_tokens
from preprocessing.prompts import DirectText

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"


def timed(call, repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), max(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--tokens", type=int, default=140, help="about this many prompt tokens")
    parser.add_argument("--repeats", type=int, default=60)
    args = parser.parse_args()
    direct = DirectText.from_params({"tokenizer_dir": args.model})
    text = " ".join(["The capital of France is"] * max(1, args.tokens // 5))
    inputs = {"text_input": np.array([[text.encode()]], dtype=np.object_),
              "request_output_len": np.array([[128]], dtype=np.int32)}
    fast = control_tokens.encode_ids

    def hf_encode(tokenizer, text, add_special_tokens, split_special_tokens=None):
        options = {} if split_special_tokens is None else {"split_special_tokens": split_special_tokens}
        return tokenizer.encode(text, add_special_tokens=add_special_tokens, **options)

    stop = threading.Event()

    def busy():  # pure Python, as a response thread sending one response after another
        while not stop.is_set():
            sum(range(1000))

    rows = []
    for label, encode in (("control_tokens.encode_ids", fast), ("tokenizer.encode", hf_encode)):
        control_tokens.encode_ids = encode
        alone = timed(lambda: direct.resolve(dict(inputs)), args.repeats)
        thread = threading.Thread(target=busy, daemon=True)
        stop.clear()
        thread.start()
        beside = timed(lambda: direct.resolve(dict(inputs)), args.repeats)
        stop.set()
        thread.join()
        rows.append((label, alone, beside))
    control_tokens.encode_ids = fast
    print(f"one request's preprocessing, ~{args.tokens} tokens (switch interval "
          f"{sys.getswitchinterval() * 1e3:.1f} ms): median / worst ms")
    for label, (a_med, a_max), (b_med, b_max) in rows:
        print(f"  {label:26s} alone {a_med:6.3f} / {a_max:6.2f}   beside a busy thread {b_med:6.3f} / {b_max:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a random-weight Llama checkpoint in a public shape, with a real tokenizer, to a folder.

    python bench/random_checkpoint.py --shape llama-3.2-1b --tokenizer TOKENIZER_DIR --out DIR

What bench/bench_gpu.py builds in memory (bench/bench_gpu_runs.py: N(0, 0.02) matrices, unit norms),
saved as safetensors so that a server can load it: serving benchmarks need a folder. The
tokenizer files are copied next to it; ids the tokenizer does not know (a 1B shape has 128,256
tokens, SmolLM2's tokenizer 49,152) decode to nothing, which is all a throughput run needs.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch

from bench_gpu_runs import SHAPES, build_hf

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "tokenizer.model")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--tokenizer", required=True, help="folder holding tokenizer.json")
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    model, folder = build_hf(args.shape, torch.device(args.device), getattr(torch, args.dtype))
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    shutil.rmtree(folder, ignore_errors=True)
    for name in TOKENIZER_FILES:
        if (Path(args.tokenizer) / name).exists():
            shutil.copy2(Path(args.tokenizer) / name, out / name)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {args.shape} ({size / 1e9:.2f} GB, {args.dtype}) to {out} in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

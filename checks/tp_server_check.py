#!/usr/bin/env python3
"""Tensor parallelism through a real tritonserver: the `tensorrt_llm` model instance spawns the
ranks itself; its greedy text must equal the in-process tp=1 engine's.

    .venv/bin/python checks/tp_server_check.py                 # CPU: SmolLM2-135M at tp=3 (gloo)
    .venv/bin/python checks/tp_server_check.py --tp 2 --device cuda --model DIR   # 2 GPUs

SmolLM2-135M has 9 heads and 3 KV heads, so tp=3 is the size that divides it (tp=2 is refused
at load with that sentence). Takes ~1 min on an idle 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from inflight.hosts.runtime import ModelRunner
from tools.local_server import running_server

REPO_ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path,
                        default=REPO_ROOT / ".cache" / "models" / "smollm2-135m-instruct")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompt", default="The capital of France is")
    args = parser.parse_args()
    start = time.time()
    with running_server(args.model, Path(tempfile.mkdtemp(prefix="tp-server-")),
                        env={"INFLIGHT_NUM_THREADS": "1"}, tensor_parallel_size=args.tp,
                        device=args.device) as server:
        print(f"server with tensor_parallel_size {args.tp} ready in {time.time() - start:.0f} s")
        reply = server.http_generate({"text_input": args.prompt, "max_tokens": 16,
                                      "apply_chat_template": False})
        got = reply[-1]["text_output"]
    print(f"tp={args.tp} server: {got!r}")
    runner = ModelRunner.from_dir(str(args.model), device=args.device)
    want = runner.generate([args.prompt], max_new_tokens=16)[0].text
    print(f"tp=1 in process: {want!r}")
    ok = got.endswith(want)
    print("MATCH" if ok else "DIFFER")
    return 0 if ok else 1


if __name__ == "__main__":  # the ranks are spawned inside the server, not from here
    sys.exit(main())

"""What a long prompt costs the streams that are already generating.

    python bench/bench_long_prompt.py [--model DIR] [--prompt-tokens 8000] [--streams 4]
                                      [--max-num-tokens 512 8192]

For each `max_num_tokens` (the per-step token budget): start `--streams` greedy streams, let them
decode a few tokens, then add one prompt of `--prompt-tokens` tokens, and step the engine until
that prompt has its first token. Prints, per budget, the inter-token latency the streams saw
while the prompt was prefilled (median and worst gap between two tokens of one stream), the
prompt's time to first token, and how many steps it took. The engine runs in this process
(no server), with chunked context on, as the repository builder configures it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import Request
from inflight.engine.llm_engine import LLMEngine

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"


def measure(engine: LLMEngine, num_streams: int, prompt_tokens: int, vocab: int) -> dict:
    # Long enough to outlive the prefill: one token per step, one chunk per step.
    max_tokens = prompt_tokens // engine.max_num_tokens + 16
    streams = [engine.add_request(Request([1 + i, 17, 42 + i], max_tokens=max_tokens, streaming=True))
               for i in range(num_streams)]
    last_token_s = {rid: None for rid in streams}
    last_token_cpu_s = dict(last_token_s)
    for _ in range(3):  # the streams are decoding before the long prompt arrives
        engine.step()
    long_prompt = [(7 + 31 * j) % (vocab - 3) + 3 for j in range(prompt_tokens)]
    start, start_cpu = time.perf_counter(), time.process_time()
    long_id = engine.add_request(Request(long_prompt, max_tokens=1))
    gaps: list[float] = []
    cpu_gaps: list[float] = []
    num_steps, first_token_s, first_token_cpu_s = 0, None, None
    while first_token_s is None:
        responses = engine.step()
        num_steps += 1
        now, now_cpu = time.perf_counter(), time.process_time()
        for response in responses:
            rid = response.request_id
            if rid == long_id:
                first_token_s, first_token_cpu_s = now - start, now_cpu - start_cpu
            elif rid in last_token_s:
                if last_token_s[rid] is not None:
                    gaps.append(now - last_token_s[rid])
                    cpu_gaps.append(now_cpu - last_token_cpu_s[rid])
                last_token_s[rid], last_token_cpu_s[rid] = now, now_cpu
    for rid in streams:
        engine.cancel(rid)
    nan = float("nan")
    return {"ttft_s": first_token_s, "ttft_cpu_s": first_token_cpu_s, "steps": num_steps,
            "itl_median_s": statistics.median(gaps) if gaps else nan,
            "itl_max_s": max(gaps) if gaps else nan,
            "itl_cpu_median_s": statistics.median(cpu_gaps) if cpu_gaps else nan,
            "itl_cpu_max_s": max(cpu_gaps) if cpu_gaps else nan}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--prompt-tokens", type=int, default=8000)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-num-tokens", type=int, nargs="+", default=[512, 8192])
    args = parser.parse_args(argv)
    print(f"model {args.model}; {args.streams} streams decoding; one prompt of "
          f"{args.prompt_tokens} tokens arrives", flush=True)
    print("wall: seconds on the clock; cpu: this process's CPU seconds (with INFLIGHT_NUM_THREADS=1,\n"
          "what the clock would show on an idle core)", flush=True)
    print(f"{'max_num_tokens':>14} {'steps':>6} {'TTFT wall/cpu s':>16} {'ITL median wall/cpu s':>22} "
          f"{'ITL max wall/cpu s':>19}", flush=True)
    for budget in args.max_num_tokens:
        config = ExecutorConfig(device="cpu", dtype="float32", max_num_tokens=budget,
                                enable_chunked_context=True, max_batch_size=args.streams + 1,
                                kv_cache_config=KvCacheConfig(max_tokens=2 * args.prompt_tokens + 4096))
        engine = LLMEngine.from_dir(args.model, config)
        r = measure(engine, args.streams, args.prompt_tokens, engine.model_config.vocab_size)
        print(f"{budget:>14} {r['steps']:>6} {r['ttft_s']:>8.1f}/{r['ttft_cpu_s']:<7.1f} "
              f"{r['itl_median_s']:>11.2f}/{r['itl_cpu_median_s']:<10.2f} "
              f"{r['itl_max_s']:>9.2f}/{r['itl_cpu_max_s']:<9.2f}", flush=True)


if __name__ == "__main__":
    main()

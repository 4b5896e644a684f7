"""In-process throughput benchmark of the in-flight batching engine, next to HF transformers.

    python bench/bench_engine.py --model .cache/models/smollm2-135m-instruct
    python bench/bench_engine.py --model DIR --device cuda --dtype bfloat16

Every request gets a prompt of 64-128 tokens (the same fixed set each run) and generates exactly
--num-tokens tokens (end_id=-1 never fires). For each concurrency C the engine is driven
directly, keeping C requests in flight until its share of the prompts is done; output tok/s is
generated tokens / wall time (prefills included). In the same run, HF `generate` (greedy,
batch 1, same dtype and device) runs the concurrency-1 prompts, and the tokens are compared.

The batch-1 decode step is set against the memory-bandwidth limit: every parameter is read
once per step (the tied LM head once), so the bound is weight bytes / bandwidth, with the
bandwidth measured in the same run (a read-only `torch.sum` over a 512 MiB tensor; the copy
figure is printed beside it). On a shared machine compare the ratios, not absolute numbers:
the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import OutputConfig, Request, SamplingConfig
from inflight.engine.llm_engine import LLMEngine

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "models" / "smollm2-135m-instruct"

# Source text for the prompts (written for this benchmark); tokenized, then cut into windows.
_TEXT = """\
The harbour town woke slowly. Fishing boats came back before sunrise with their nets folded on
deck, and the first cafes opened their shutters while gulls argued over the scraps left on the
quay. By seven the bakery had sold most of its bread, and the ferry to the islands was already
loading cars, bicycles and crates of vegetables for the weekly market. Visitors rarely noticed
how carefully the day was arranged: the tide tables decided when the boats left, the ferry
timetable decided when the shops opened, and the church bell, which had rung at the same hours
for three centuries, decided when everyone stopped for lunch. In winter the town emptied. Half
the houses were closed, the hotels covered their furniture with white sheets, and the people
who stayed repaired nets, painted hulls and argued about the council's plan to extend the
breakwater. The plan had been discussed for eleven years. Engineers had measured the currents,
biologists had counted the seagrass, and every family had an opinion about whether a longer
wall would protect the harbour or ruin the beach that the summer visitors loved. Explain, step
by step, how a small community could reach a decision on such a project, which evidence it
should collect first, who should be consulted, and how the costs could be shared fairly
between the residents, the regional government and the businesses that depend on tourism.
"""


@dataclass
class RunResult:
    concurrency: int
    num_requests: int
    num_output_tokens: int
    wall_s: float
    decode_steps_s: list[float] = field(default_factory=list)  # steps with no prefill in them
    ttft_s: list[float] = field(default_factory=list)  # add_request -> end of its prefill step
    outputs: dict[int, list[int]] = field(default_factory=dict)  # prompt index -> tokens

    @property
    def tok_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s

    @property
    def decode_step_s(self) -> float:
        return statistics.median(self.decode_steps_s) if self.decode_steps_s else float("nan")


def build_prompts(model_dir: Path, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` token lists of 64..128 tokens, identical from run to run."""
    lengths = [64 + (37 * i) % 65 for i in range(num_prompts)]
    try:
        from transformers import AutoTokenizer
        tokens = AutoTokenizer.from_pretrained(str(model_dir)).encode(_TEXT, add_special_tokens=False)
    except Exception:  # no tokenizer in the folder: fixed pseudo-random ids
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(100, 20000, (512,), generator=gen).tolist()
    while len(tokens) < 128 + 7 * num_prompts:
        tokens = tokens + tokens
    return [tokens[7 * i: 7 * i + n] for i, n in enumerate(lengths)]


def measure_bandwidth(device: torch.device) -> tuple[float, float]:
    """(read GB/s via torch.sum, copy GB/s counting read + write) over 512 MiB fp32 tensors."""
    numel = 128 * 2**20
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)

    def best_of(fn, repeats=5) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            best = min(best, time.perf_counter() - start)
        return best

    read = src.numel() * 4 / best_of(lambda: src.sum()) / 1e9
    copy = 2 * src.numel() * 4 / best_of(lambda: dst.copy_(src)) / 1e9
    return read, copy


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_request(prompt: list[int], num_tokens: int) -> Request:
    return Request(input_token_ids=prompt, max_tokens=num_tokens, end_id=-1,
                   sampling_config=SamplingConfig(),
                   output_config=OutputConfig(exclude_input_from_output=True))


def run_engine(engine: LLMEngine, prompts: list[list[int]], concurrency: int,
               num_tokens: int) -> RunResult:
    """Keeps `concurrency` requests in flight until every prompt is generated."""
    pending = list(range(len(prompts)))
    live: dict[int, tuple[int, float]] = {}  # request id -> (prompt index, submit time)
    result = RunResult(concurrency, len(prompts), 0, 0.0)
    waiting_first: dict[int, float] = {}

    def submit() -> None:
        while pending and len(live) < concurrency:
            index = pending.pop(0)
            rid = engine.add_request(make_request(prompts[index], num_tokens))
            now = time.perf_counter()
            live[rid] = (index, now)
            waiting_first[rid] = now

    start = time.perf_counter()
    submit()
    while live:
        step_start = time.perf_counter()
        responses = engine.step()
        step_end = time.perf_counter()
        stats = engine.last_stats.inflight_batching_stats
        if stats.num_context_requests == 0:
            result.decode_steps_s.append(step_end - step_start)
        # A request's first token exists once it has been in a step that computed its prompt.
        for rid in list(waiting_first):
            state = engine.requests.get(rid)
            if state is None or state.seq.num_generated_tokens > 0:
                result.ttft_s.append(step_end - waiting_first.pop(rid))
        for response in responses:
            if response.has_error():
                raise RuntimeError(response.error_msg)
            if response.result.is_final:
                index, _ = live.pop(response.request_id)
                tokens = response.result.output_token_ids[0]
                result.outputs[index] = tokens
                result.num_output_tokens += len(tokens)
        submit()
    result.wall_s = time.perf_counter() - start
    return result


def run_hf(model, prompts: list[list[int]], num_tokens: int, device: torch.device):
    """HF generate, batch 1, greedy: (tok/s, median prefill s, median decode step s, outputs)."""
    outputs, gen_times, prefill_times = [], [], []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            sync(device)
            start = time.perf_counter()
            model(ids, use_cache=True)
            sync(device)
            prefill_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                 min_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            sync(device)
            gen_times.append(time.perf_counter() - start)
            outputs.append(out[0, len(prompt):].tolist())
    tok_per_s = num_tokens * len(prompts) / sum(gen_times)
    prefill = statistics.median(prefill_times)
    decode_step = statistics.median((g - p) / max(num_tokens - 1, 1)
                                    for g, p in zip(gen_times, prefill_times))
    return tok_per_s, prefill, decode_step, outputs


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied LM head counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def agreement(ours: list[int], ref: list[int]) -> int:
    """Length of the common prefix."""
    n = 0
    for a, b in zip(ours, ref):
        if a != b:
            break
        n += 1
    return n


def load_str() -> str:
    try:
        one, five, fifteen = os.getloadavg()
        return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"
    except OSError:
        return "load average unavailable"


def _busy() -> bool:
    try:
        return os.getloadavg()[0] > 0.5 * (os.cpu_count() or 1)
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--num-tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--concurrency", default="1,8,32",
                        help="comma-separated list of requests kept in flight")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="prompt set size; concurrency C runs max(C, --min-requests) of them")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="requests per concurrency level at least (c=1 runs this many)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU intra-op threads (default: torch's choice)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run HF transformers")
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    prompts = build_prompts(args.model, max(args.num_prompts, max(concurrencies), args.min_requests))
    print(f"# bench_engine: {args.model.name}, {args.dtype} on {args.device}, "
          f"{args.num_tokens} tokens/request, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} CPU threads, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    if device.type == "cuda":
        print(f"# GPU: {torch.cuda.get_device_name(device)}")
    print(f"# before: {load_str()}", flush=True)
    if device.type == "cpu" and torch.get_num_threads() > 1 and _busy():
        print("# note: other processes keep the CPUs busy; with several torch threads every op "
              "waits for its slowest thread, so steps can be many times slower and noisy. "
              "Compare ratios, or pass --threads 1.", flush=True)

    read_bw, copy_bw = measure_bandwidth(device)
    print(f"# bandwidth ({'GPU' if device.type == 'cuda' else 'host'} memory, 512 MiB fp32): "
          f"read (torch.sum) {read_bw:.1f} GB/s, copy (read+write counted) {copy_bw:.1f} GB/s",
          flush=True)

    load_start = time.perf_counter()
    max_c = max(concurrencies)
    max_len = max(map(len, prompts)) + args.num_tokens
    engine = LLMEngine.from_dir(args.model, ExecutorConfig(
        device=args.device, dtype=args.dtype, max_batch_size=max_c,
        max_num_tokens=max(8192, max_c * max_len), max_seq_len=max_len,
        kv_cache_config=KvCacheConfig(max_tokens=max_c * max_len + 64,
                                      host_memory_bytes=4 << 30)))
    model_bytes = weight_bytes(engine.worker.model)
    print(f"# engine loaded in {time.perf_counter() - load_start:.1f} s; weights "
          f"{model_bytes / 1e6:.1f} MB", flush=True)

    # Warm up: allocator, kernels, a mixed step.
    run_engine(engine, prompts[:2], 2, 4)
    results: list[RunResult] = []
    for c in concurrencies:
        n = max(c, args.min_requests)
        res = run_engine(engine, prompts[:n], c, args.num_tokens)
        results.append(res)
        print(f"#   c={c}: {res.tok_per_s:.1f} tok/s ({res.num_output_tokens} tokens in "
              f"{res.wall_s:.1f} s), decode step {res.decode_step_s * 1e3:.1f} ms", flush=True)

    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        hf_model = AutoModelForCausalLM.from_pretrained(
            str(args.model), dtype=engine.worker.dtype).to(device).eval()
        hf_prompts = prompts[:max(1, args.min_requests)]
        model_generate_warmup = hf_prompts[0][:16]
        run_hf(hf_model, [model_generate_warmup], 4, device)
        hf = run_hf(hf_model, hf_prompts, args.num_tokens, device)
        del hf_model
    print(f"# after: {load_str()}\n")

    # ----- report --------------------------------------------------------------------------
    header = (f"{'engine':<22} {'conc':>4} {'reqs':>4} {'out tok':>7} {'wall s':>7} "
              f"{'out tok/s':>9} {'decode step ms':>14} {'decode tok/s':>12}")
    print(header)
    print("-" * len(header))
    for r in results:
        step = r.decode_step_s
        print(f"{'inflight':<22} {r.concurrency:>4} {r.num_requests:>4} {r.num_output_tokens:>7} "
              f"{r.wall_s:>7.2f} {r.tok_per_s:>9.1f} {step * 1e3:>14.1f} "
              f"{r.concurrency / step if step == step else float('nan'):>12.1f}")
    if hf is not None:
        hf_tps, hf_prefill, hf_step, hf_outputs = hf
        n = len(hf_outputs)
        print(f"{'HF generate (batch 1)':<22} {1:>4} {n:>4} {n * args.num_tokens:>7} "
              f"{n * args.num_tokens / hf_tps:>7.2f} {hf_tps:>9.1f} {hf_step * 1e3:>14.1f} "
              f"{1 / hf_step:>12.1f}")
    print()

    by_c = {r.concurrency: r for r in results}
    if 1 in by_c:
        c1 = by_c[1]
        print(f"c=1 TTFT (submit -> first token; the prefill step): median "
              f"{statistics.median(c1.ttft_s) * 1e3:.1f} ms over {len(c1.ttft_s)} requests "
              f"of {min(map(len, prompts[:c1.num_requests]))}-"
              f"{max(map(len, prompts[:c1.num_requests]))} prompt tokens")
        if hf is not None:
            print(f"HF prefill (one forward of the prompt, batch 1): median {hf[1] * 1e3:.1f} ms")
        bound_s = model_bytes / (read_bw * 1e9)
        print(f"batch-1 memory-bandwidth bound: {model_bytes / 1e6:.0f} MB / {read_bw:.1f} GB/s = "
              f"{bound_s * 1e3:.1f} ms/step ({1 / bound_s:.1f} tok/s); inflight decode step "
              f"{c1.decode_step_s * 1e3:.1f} ms = {bound_s / c1.decode_step_s:.0%} of the bound "
              f"({model_bytes / c1.decode_step_s / 1e9:.1f} GB/s effective)"
              + (f"; HF step {hf[2] * 1e3:.1f} ms = {bound_s / hf[2]:.0%}" if hf else ""))
    print("ratios:")
    if 1 in by_c and hf is not None:
        c1 = by_c[1]
        print(f"  inflight c=1 / HF batch 1: output tok/s {c1.tok_per_s / hf[0]:.2f}x, "
              f"decode step time {c1.decode_step_s / hf[2]:.2f}x (lower is faster)")
        same = [agreement(c1.outputs[i], hf[3][i]) for i in range(min(len(hf[3]), len(c1.outputs)))]
        print(f"  greedy tokens equal to HF: {sum(s == args.num_tokens for s in same)}/{len(same)} "
              f"requests fully; common prefix lengths {same}")
    for c in concurrencies:
        if c != 1 and 1 in by_c:
            print(f"  c={c} / c=1 output tok/s: {by_c[c].tok_per_s / by_c[1].tok_per_s:.2f}x "
                  f"(decode tok/s {c / by_c[c].decode_step_s / (1 / by_c[1].decode_step_s):.2f}x)")


if __name__ == "__main__":
    main()

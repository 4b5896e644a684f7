"""The two sides of bench/bench_serving.py: the same load in process and through Triton.

Both sides run the same prompts (`build_prompts`: texts whose tokenization by the ensemble's
tokenizer is about `length` tokens; the in-process side gets exactly those ids), ask for
exactly `num_tokens` tokens (greedy, end id off, min_tokens = max_tokens) and keep
`concurrency` requests in flight. Latencies per request: TTFT = first token − submit,
ITL = (last token − first token) / (tokens − 1), the definition genai-perf uses, so a response
that carries several tokens is neither penalised nor flattered.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_engine import _TEXT

from inflight.api.types import OutputConfig, Request, SamplingConfig
from preprocessing.tokenizer import TextTokenizer


@dataclass
class Level:
    """One path at one concurrency."""

    path: str
    concurrency: int
    num_requests: int = 0
    num_tokens: int = 0
    wall_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def tok_per_s(self) -> float:
        return self.num_tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def ttft_p50_ms(self) -> float:
        return 1000 * statistics.median(self.ttft_s) if self.ttft_s else float("nan")

    @property
    def itl_p50_ms(self) -> float:
        return 1000 * statistics.median(self.itl_s) if self.itl_s else float("nan")


def build_prompts(tokenizer_dir: str, count: int, length: int) -> tuple[list[str], list[list[int]]]:
    """`count` distinct texts of about `length` tokens and their ids as the ensemble makes them."""
    tokenizer = TextTokenizer(tokenizer_dir)
    source = tokenizer.encode(_TEXT, apply_chat_template=False, add_special_tokens=False)
    while len(source) < length + 7 * count:
        source = source + source
    texts, ids = [], []
    for i in range(count):
        text = tokenizer.tokenizer.decode(source[7 * i: 7 * i + length], skip_special_tokens=True)
        texts.append(text)
        ids.append(tokenizer.encode(text, apply_chat_template=False, add_special_tokens=None))
    return texts, ids


def _request(prompt: list[int], num_tokens: int) -> Request:
    return Request(input_token_ids=prompt, max_tokens=num_tokens, end_id=-1, streaming=True,
                   sampling_config=SamplingConfig(min_tokens=num_tokens),
                   output_config=OutputConfig(exclude_input_from_output=True))


def run_in_process(engine, prompts: list[list[int]], concurrency: int, num_requests: int,
                   num_tokens: int, stagger: bool = False) -> Level:
    """Drive the engine directly (public calls only), `concurrency` requests in flight.

    Identical requests started together stay in lockstep: every step a pure decode of all of
    them. Through a server they arrive spread out, so most steps also prefill a newcomer.
    `stagger` admits the first `concurrency` requests one per engine step, which spreads them
    over the first steps of their lives and keeps them spread (closed loop), as served."""
    level = Level("in process, staggered" if stagger else "in process", concurrency, num_requests)
    queue = [prompts[i % len(prompts)] for i in range(num_requests)]
    live: dict[int, list[float]] = {}  # request id -> [submit, first token, last token]
    num_admitted = 0
    start = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            live[engine.add_request(_request(queue.pop(0), num_tokens))] = [time.perf_counter()]
            num_admitted += 1
            if stagger and num_admitted <= concurrency:
                break
        responses = engine.step()
        now = time.perf_counter()
        for response in responses:
            if response.has_error():
                raise RuntimeError(response.error_msg)
            times = live[response.request_id]
            if response.result.output_token_ids[0]:
                times[1:] = [times[1] if len(times) > 1 else now, now]
            level.num_tokens += len(response.result.output_token_ids[0])
            if response.result.is_final:
                submit, first, last = live.pop(response.request_id)
                level.ttft_s.append(first - submit)
                level.itl_s.append((last - first) / max(num_tokens - 1, 1))
    level.wall_s = time.perf_counter() - start
    return level


def perf_analyzer_inputs(path: Path, texts: list[str], num_tokens: int, stream: bool) -> Path:
    data = [{"text_input": [t], "max_tokens": [num_tokens], "min_tokens": [num_tokens],
             "end_id": [-1], "stream": [stream], "exclude_input_in_output": [True]} for t in texts]
    path.write_text(json.dumps({"data": data}))
    return path


def run_perf_analyzer(binary: str, grpc_url: str, inputs: Path, concurrency: int, requests_per_window: int,
                      num_tokens: int, path: str, work_dir: Path, timeout_s: float = 1800) -> Level:
    """perf_analyzer against the ensemble (gRPC streaming, the only way to a decoupled model);
    three count windows, taken as stable (latencies come from its per-request export)."""
    export = work_dir / f"pa_{path.replace(' ', '_')}_{concurrency}.json"
    export.unlink(missing_ok=True)  # a level run again (--repeat): perf_analyzer will not overwrite
    cmd = [binary, "-m", "ensemble", "-i", "grpc", "--async", "--streaming", "-u", grpc_url,
           "--input-data", str(inputs), "--concurrency-range", str(concurrency),
           "--measurement-mode", "count_windows", "--measurement-request-count", str(requests_per_window),
           "--stability-percentage", "999", "--profile-export-file", str(export)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    # rc 2: "no stable measurement" (a window with too few requests ending in it, on a slow CPU
    # engine); the figures here come from the per-request export, not from its stability.
    if proc.returncode not in (0, 2) or not export.exists():
        raise RuntimeError(f"perf_analyzer failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return parse_profile_export(json.loads(export.read_text()), path, concurrency, num_tokens)


def parse_profile_export(profile: dict, path: str, concurrency: int, num_tokens: int) -> Level:
    """Requests of the last experiment: each made exactly `num_tokens` tokens."""
    requests = [r for r in profile["experiments"][-1]["requests"] if r.get("response_timestamps")]
    level = Level(path, concurrency, len(requests), num_tokens * len(requests))
    start = min(r["timestamp"] for r in requests)
    end = max(r["response_timestamps"][-1] for r in requests)
    level.wall_s = (end - start) / 1e9
    for r in requests:
        stamps = r["response_timestamps"]
        level.ttft_s.append((stamps[0] - r["timestamp"]) / 1e9)
        level.itl_s.append((stamps[-1] - stamps[0]) / 1e9 / max(num_tokens - 1, 1))
    return level

"""Measurements for bench/bench_gpu.py, bench_gpu_checks.py and bench_gpu_mixed.py: random-weight
models in public shapes, engine and HF `generate` runs, the bandwidth roofline, and profiled
engine steps. No printing here."""

from __future__ import annotations

import gc
import json
import math
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import OutputConfig, Request
from inflight.engine.llm_engine import LLMEngine

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         tie_word_embeddings=True, max_position_embeddings=131072,
                         rope=dict(LLAMA3_ROPE, factor=32.0)),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         tie_word_embeddings=False, max_position_embeddings=131072,
                         rope=dict(LLAMA3_ROPE, factor=8.0)),
    # For --tiny dry runs on a CPU: every code path, in seconds.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True,
                 max_position_embeddings=4096, rope=dict(LLAMA3_ROPE, factor=8.0,
                                                         original_max_position_embeddings=64)),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s, read + write counted (best of 10)."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = float("inf")
    for _ in range(10):
        sync(device)
        start = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - start)
    del x, y
    free_memory(device)
    return 2 * nbytes / best


# ----- models --------------------------------------------------------------------------------

def build_hf(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight HF Llama of `shape` built on `device` (N(0, 0.02) matrices, unit norms),
    and a folder holding its config.json (what our loader reads next to in-memory weights)."""
    import transformers
    spec = dict(SHAPES[shape])
    rope = spec.pop("rope")
    cfg = transformers.LlamaConfig(**spec, rope_parameters=rope, rms_norm_eps=1e-5,
                                   bos_token_id=None, eos_token_id=None, pad_token_id=None)
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{shape}-"))
    cfg.save_pretrained(folder)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval(), folder


def weight_bytes_read(model: torch.nn.Module, tied: bool) -> int:
    """Bytes of weights read per decode step: every matrix once, as stored (a 4-bit layer's
    packed words and scales); the input embedding is only gathered (a few rows), unless it is
    also the (tied) LM head."""
    seen, total = set(), 0
    tensors = list(model.named_parameters())
    for name, module in model.named_modules():
        if hasattr(module, "read_tensors"):
            tensors += [(f"{name}.read{i}", t) for i, t in enumerate(module.read_tensors())]
    for name, p in tensors:
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.endswith("embed_tokens.weight") and not tied:
            continue
        total += p.numel() * p.element_size()
    return total


INT4_GROUP = 128  # the W4A16 checkpoints' group (llm-compressor's W4A16 preset)


def int4_checkpoint(weights: dict, folder: Path, group_size: int = INT4_GROUP) -> Path:
    """The decoder projections of `weights` (HF names, on the GPU) rounded to symmetric 4-bit
    groups and packed as compressed-tensors writes them, next to a copy of `folder`'s
    config.json with the matching quantization_config. Returns the new folder; `weights` is
    changed in place (each projection's tensor replaced as it is packed, to bound memory)."""
    from inflight.model.quantization import int4

    names = [n for n in weights if n.endswith("_proj.weight") and ".layers." in n]
    group_size = math.gcd(group_size, *(weights[n].shape[1] for n in names))  # tiny shapes: smaller
    for name in names:
        w = weights.pop(name).float()  # [N, K]
        grouped = w.unflatten(1, (-1, group_size))
        scale = (grouped.abs().amax(dim=2) / 7.5).clamp_min(1e-8)  # [N, K / group]
        q = (grouped / scale.unsqueeze(-1)).round().clamp(-8, 7).to(torch.int8).flatten(1)
        prefix = name.removesuffix(".weight")
        weights[f"{prefix}.weight_packed"] = int4.pack(q)
        weights[f"{prefix}.weight_scale"] = scale.to(torch.bfloat16)
        weights[f"{prefix}.weight_shape"] = torch.tensor(w.shape)
        del w, grouped, q
    out = Path(str(folder) + "-w4a16")
    out.mkdir(exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": group_size}}}}
    (out / "config.json").write_text(json.dumps(config))
    return out


def make_engine(folder: Path, weights, device: torch.device, dtype: str, max_batch_size: int,
                max_seq_len: int, kv_cache_dtype: str = "auto", max_num_tokens: int = 8192,
                **overrides) -> LLMEngine:
    config = ExecutorConfig(device=str(device), dtype=dtype, max_batch_size=max_batch_size,
                            max_num_tokens=max_num_tokens, max_seq_len=max_seq_len,
                            enable_chunked_context=True,
                            kv_cache_config=KvCacheConfig(
                                tokens_per_block=32, dtype=kv_cache_dtype,
                                max_tokens=None if device.type == "cuda" else max_batch_size * max_seq_len),
                            **overrides)
    return LLMEngine.from_dir(str(folder), config, weights=weights)


# ----- workloads -----------------------------------------------------------------------------

def random_prompts(n: int, lengths, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lens = lengths if isinstance(lengths, list) else [lengths] * n
    return [[rng.randrange(10, vocab) for _ in range(lens[i])] for i in range(n)]


@dataclass
class EngineRun:
    num_requests: int
    input_len: str
    output_len: str
    wall_s: float
    output_tokens: int
    decode_tok_s: float
    e2e_tok_s: float
    decode_step_ms: float  # median over decode-only steps
    max_concurrency: int
    first_step_s: float  # submit -> end of the first step
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    timed_out: bool = False

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        return d


def run_engine(engine: LLMEngine, prompts: list[list[int]], out_lens: list[int], deadline: float,
               keep_outputs: bool = False, loras: list | None = None) -> EngineRun:
    """Submits every request at once (greedy, no end id) and steps until all are done;
    `loras`: each request's `LoraConfig` (None: the base model).

    decode tok/s counts the tokens generated from the first step with no prefill in it to the
    end, over that window's wall time; e2e tok/s is all output tokens over the whole run.
    """
    device = engine.worker.device
    sync(device)
    start = time.perf_counter()
    ids = [engine.add_request(Request(p, n, output_config=OutputConfig(exclude_input_from_output=True),
                                      lora_config=loras[i] if loras else None))
           for i, (p, n) in enumerate(zip(prompts, out_lens))]
    outputs: dict[int, list[int]] = {}
    window = None  # (time, tokens generated before it)
    step_times, concurrency, first_step = [], 0, None
    timed_out = False
    while engine.has_unfinished():
        before = time.perf_counter()
        generated = None
        if window is None:
            generated = sum(st.seq.num_generated_tokens for st in engine.requests.values()) + \
                sum(len(v) for v in outputs.values())
        for r in engine.step():
            if r.has_error():
                raise RuntimeError(r.error_msg)
            if r.result.is_final:
                outputs[r.request_id] = r.result.output_token_ids[0]
        after = time.perf_counter()
        first_step = first_step or after - start
        stats = engine.last_stats.inflight_batching_stats
        concurrency = max(concurrency, stats.num_scheduled_requests)
        if stats.num_ctx_tokens == 0 and stats.num_scheduled_requests:
            if window is None:
                window = (before, generated)
            step_times.append(after - before)
        if after > deadline:
            timed_out = True
            cancel_all(engine, [rid for rid in ids if rid not in outputs])
            break
    sync(device)
    end = time.perf_counter()
    total = sum(len(v) for v in outputs.values())
    window = window or (start, 0)
    decode_tokens = total - window[1]
    return EngineRun(len(prompts), _lens(prompts), _lens(out_lens, plain=True), end - start, total,
                     decode_tokens / max(end - window[0], 1e-9), total / (end - start),
                     1e3 * statistics.median(step_times) if step_times else float("nan"),
                     concurrency, first_step or 0.0,
                     [outputs.get(i, []) for i in ids] if keep_outputs else [], timed_out)


def _lens(items, plain: bool = False) -> str:
    values = items if plain else [len(p) for p in items]
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def hf_generate(model, prompts: list[list[int]], max_new_tokens: int, device: torch.device
                ) -> tuple[float, list[list[int]]]:
    """Seconds for one batched greedy `generate` (left-padded), and the new tokens per row."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, device=device)
        mask[i, width - len(p):] = 1
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=0)
    sync(device)
    return time.perf_counter() - start, out[:, width:].tolist()


# ----- roofline and profile ------------------------------------------------------------------

def roofline_tok_s(batch: int, mean_context: float, weight_bytes: int, kv_bytes_per_token: int,
                   bandwidth: float) -> float:
    """Decode tokens/s if a step only had to read the weights and the rows' KV at `bandwidth`."""
    return batch * bandwidth / (weight_bytes + batch * mean_context * kv_bytes_per_token)


def profile_decode(engine: LLMEngine, batch: int, prompt_len: int, vocab: int,
                   num_steps: int = 8, top: int = 0, trace_path: Path | None = None) -> dict:
    """Kernels per decode step and GPU busy time vs wall time, from torch.profiler over
    `num_steps` steady decode steps of `batch` rows; with `top`, also `top_kernels`: the
    `top` kernels by GPU time (name, us and launches per step, % of the busy time); with
    `trace_path`, the profile as a Chrome trace there."""
    prompts = random_prompts(batch, prompt_len, vocab, seed=99)
    ids = [engine.add_request(Request(p, num_steps + 24)) for p in prompts]
    for _ in range(12):  # prefill, then a few decode steps (graphs and caches warm)
        engine.step()

    def steps():
        for _ in range(num_steps):
            engine.step()
    summary = profile_steps(steps, num_steps, engine.worker.device, top, trace_path)
    cancel_all(engine, ids)
    return dict(batch=batch, **summary)


def profile_steps(run, num_steps: int, device: torch.device, top: int = 0,
                  trace_path: Path | None = None) -> dict:
    """`kernel_summary` of `run()`, which runs `num_steps` engine steps, under torch.profiler
    (the device synced before and after); with `trace_path`, the Chrome trace written there."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run()
        sync(device)
        wall = time.perf_counter() - start
    if trace_path is not None:
        prof.export_chrome_trace(str(trace_path))
    return kernel_summary(prof, num_steps, wall, top)


def cancel_all(engine: LLMEngine, request_ids) -> None:
    """Cancels the requests and steps the engine until nothing is left in flight."""
    for rid in request_ids:
        engine.cancel(rid)
    while engine.has_unfinished():
        engine.step()


def kernel_summary(prof, num_steps: int, wall: float, top: int = 0) -> dict:
    """Kernels per step, GPU busy (union of kernel intervals) and wall ms per step of a
    torch.profiler run over `num_steps` steps taking `wall` seconds; with `top`, the `top`
    kernels by GPU time (name, us and launches per step, % of the busy time)."""
    kernels, intervals, by_name = 0, [], {}
    for evt in prof.events():
        if getattr(evt.device_type, "name", "") == "CUDA":
            kernels += 1
            intervals.append((evt.time_range.start, evt.time_range.end))
            total = by_name.setdefault(evt.name, [0.0, 0])
            total[0] += evt.time_range.end - evt.time_range.start
            total[1] += 1
    busy_us, last_end = 0.0, float("-inf")
    for s, e in sorted(intervals):  # union of device intervals
        if e > last_end:
            busy_us += e - max(s, last_end)
            last_end = e
    result = {"kernels_per_step": kernels / num_steps,
              "gpu_busy_ms_per_step": busy_us / 1e3 / num_steps,
              "wall_ms_per_step": wall * 1e3 / num_steps}
    if top:
        ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
        result["top_kernels"] = [
            {"name": name[:120], "us_per_step": us / num_steps, "launches_per_step": n / num_steps,
             "share_pct": 100 * us / max(busy_us, 1e-9)} for name, (us, n) in ranked]
    return result

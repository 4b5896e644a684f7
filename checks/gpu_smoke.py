"""GPU smoke test: the engine on CUDA (bf16 and fp32) against CPU fp32 greedy tokens.

    # where the model folder exists (CPU is enough): greedy tokens, logit margins, weight digest
    python checks/gpu_smoke.py reference --model .cache/models/smollm2-135m-instruct --out ref.json
    # on the GPU machine
    python checks/gpu_smoke.py check --model DIR [--reference ref.json] [--num-tokens 20]
    # no real weights there: a SmolLM2-shaped checkpoint with random weights
    python checks/gpu_smoke.py random-model --out DIR

`check` loads the model into the engine four times (CPU fp32 on that machine, CUDA fp32, CUDA
bf16, and HF transformers CUDA bf16) and compares each one's greedy tokens with the CPU fp32
reference (the carried one when given, else the one computed there). Where a run diverges it
prints the first divergent index and the logit margins there: the fp32 margin (top-1 minus
top-2 on the reference sequence, teacher forced) and how far the diverging run preferred its
own token. bf16 drifting from fp32 after some tokens is expected when the margin is small; a
CUDA fp32 divergence is not (unless the fp32 margin is float noise). It also audits one prefill
and one decode step for host synchronisations (`torch.cuda.set_sync_debug_mode`).

Exit status: 0 when CUDA fp32 matches the CPU fp32 reference on every prompt (or diverges only
at a fp32 margin below 0.01, a near tie) and nothing errored; 1 otherwise. bf16 divergence is reported,
not failed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from inflight.api.config import ExecutorConfig, KvCacheConfig
from inflight.api.types import OutputConfig, Request, SamplingConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.model.attention import StepMetadata
from inflight.model.loader import allocate_kv_caches, load_model

# Chat prompts (ChatML, as the instruct model expects); token ids are stored in the reference.
PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of copper.",
]
# Used when the folder has no tokenizer (random-weight fallback): fixed ids.
FALLBACK_PROMPT_IDS = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198,
                        23021, 260, 3458, 282, 4649, 47, 2, 198, 1, 520, 9531, 198],
                       list(range(100, 140)), list(range(5000, 5063, 3)), [1, 4093, 198, 42, 2, 198]]
# SmolLM2-135M-Instruct's shape, for the random-weight fallback.
SMOLLM2_CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
BLOCK = 32


def log(msg: str) -> None:
    print(msg, flush=True)


# ----- building blocks ---------------------------------------------------------------------

def weight_digest(model_dir: Path) -> dict[str, str]:
    """sha256 of each tensor's dtype, shape and raw bytes, plus "__all__" over all of them."""
    from safetensors import safe_open
    digests = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                t = f.get_tensor(name).contiguous()
                h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                digests[name] = h.hexdigest()
    total = hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(digests.items())).encode())
    digests["__all__"] = total.hexdigest()
    return digests


def prompt_ids(model_dir: Path) -> list[list[int]]:
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception:
        return FALLBACK_PROMPT_IDS
    ids = []
    for text in PROMPTS:
        chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        ids.append(tok.encode(chat, add_special_tokens=False))
    return ids


def engine_greedy(model_dir: Path, prompts: list[list[int]], num_tokens: int, device: str,
                  dtype: str) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt, all in flight together; (tokens, seconds)."""
    engine = LLMEngine.from_dir(model_dir, ExecutorConfig(
        device=device, dtype=dtype, max_batch_size=len(prompts), max_seq_len=512,
        kv_cache_config=KvCacheConfig(max_tokens=len(prompts) * 512)))
    ids = [engine.add_request(Request(input_token_ids=p, max_tokens=num_tokens, end_id=-1,
                                      sampling_config=SamplingConfig(),
                                      output_config=OutputConfig(exclude_input_from_output=True)))
           for p in prompts]
    out = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        for r in engine.step():
            if r.has_error():
                raise RuntimeError(r.error_msg)
            if r.result.is_final:
                out[r.request_id] = r.result.output_token_ids[0]
    seconds = time.perf_counter() - start
    del engine
    return [out[i] for i in ids], seconds


@torch.inference_mode()
def teacher_forced_logits(model, prompt: list[int], continuation: list[int],
                          device: torch.device) -> torch.Tensor:
    """[len(continuation), vocab] fp32 logits predicting each continuation token."""
    seq = prompt + continuation
    num_blocks = -(-len(seq) // BLOCK)
    caches = allocate_kv_caches(model.config, num_blocks, BLOCK, next(model.parameters()).dtype, device)
    meta = StepMetadata.build([(0, len(seq), list(range(num_blocks)))], BLOCK, device, input_ids=seq)
    hidden = model(meta.input_ids, meta.positions, caches, model.attention_backend.build_metadata(meta))
    rows = hidden[len(prompt) - 1: len(seq) - 1]
    return model.compute_logits(rows).float().cpu()


def margins(logits: torch.Tensor) -> list[float]:
    top2 = logits.topk(2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def hf_greedy(model_dir: Path, prompts: list[list[int]], num_tokens: int, device: str,
              dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_tokens,
                                 min_new_tokens=num_tokens, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
            outs.append(seq[0, len(p):].tolist())
    del model
    return outs


def sync_audit(model_dir: Path, prompt: list[int]) -> list[str]:
    """Host syncs seen during one decode step and one prefill+decode step on CUDA.

    torch.cuda.set_sync_debug_mode("warn") warns at every synchronising CUDA call; the warning
    is caught while the op's Python caller is still on the stack, so each sync is reported
    with the innermost frames that led to it.
    """
    engine = LLMEngine.from_dir(model_dir, ExecutorConfig(device="cuda", dtype="bfloat16",
                                                      max_batch_size=2, max_seq_len=512,
                                                      kv_cache_config=KvCacheConfig(max_tokens=1024)))
    for _ in range(2):
        engine.add_request(Request(input_token_ids=prompt, max_tokens=4, end_id=-1))
    engine.step()  # warm-up prefill (allocator, kernels)
    engine.step()
    found = []
    for label in ("decode", "prefill+decode"):
        if label == "prefill+decode":
            engine.add_request(Request(input_token_ids=prompt, max_tokens=4, end_id=-1))
        torch.cuda.synchronize()
        syncs = []

        def show(message, category, filename, lineno, file=None, line=None):
            if "called a synchronizing" not in str(message):
                return  # e.g. the "prototype feature" notice of set_sync_debug_mode itself
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:4])
            syncs.append(f"{str(message).strip()[:60]!r} at {where}")

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found.append(f"{label} step: {len(syncs)} host sync(s)")
        found.extend(f"    {s}" for s in syncs)
    return found


def profile_decode(model_dir: Path, prompt: list[int], batch: int) -> list[str]:
    """One CUDA bf16 decode step of `batch` rows under torch.profiler: where the time goes."""
    from torch.profiler import ProfilerActivity, profile
    engine = LLMEngine.from_dir(model_dir, ExecutorConfig(device="cuda", dtype="bfloat16",
                                                      max_batch_size=batch, max_seq_len=512,
                                                      kv_cache_config=KvCacheConfig(max_tokens=batch * 512)))
    for _ in range(batch):
        engine.add_request(Request(input_token_ids=prompt, max_tokens=16, end_id=-1))
    for _ in range(4):
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        engine.step()
    wall = (time.perf_counter() - start) / 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    lines = [f"batch {batch}: decode step {wall * 1e3:.2f} ms wall (mean of 5, no profiler); "
             f"profiled step: {kernels} GPU kernels/copies, {gpu_us / 1e3:.2f} ms of GPU time"]
    cpu_ops = sorted((e for e in events if e.device_type.name == "CPU" and e.key.startswith("aten::")),
                     key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    lines.append("  top aten ops by host time: " + ", ".join(
        f"{e.key[6:]} x{e.count} {e.self_cpu_time_total / 1e3:.2f} ms" for e in cpu_ops))
    return lines


# ----- subcommands -------------------------------------------------------------------------

def cmd_reference(args) -> int:
    prompts = prompt_ids(args.model)
    log(f"CPU fp32 greedy reference: {len(prompts)} prompts x {args.num_tokens} tokens")
    tokens, seconds = engine_greedy(args.model, prompts, args.num_tokens, "cpu", "float32")
    model, _ = load_model(args.model, torch.float32, "cpu")
    ref_margins = []
    for p, t in zip(prompts, tokens):
        logits = teacher_forced_logits(model, p, t, torch.device("cpu"))
        assert logits.argmax(-1).tolist() == t, "teacher-forced argmax differs from greedy tokens"
        ref_margins.append(margins(logits))
    data = {"prompts": prompts, "num_tokens": args.num_tokens, "tokens": tokens,
            "fp32_margins": ref_margins, "weights": weight_digest(args.model),
            "made_with": f"torch {torch.__version__} on cpu"}
    Path(args.out).write_text(json.dumps(data))
    log(f"wrote {args.out} ({seconds:.1f} s of generation); weights digest "
        f"{data['weights']['__all__'][:16]}")
    return 0


def cmd_random_model(args) -> int:
    import transformers
    out = Path(args.out)
    cfg = transformers.LlamaConfig(**SMOLLM2_CONFIG, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    log(f"wrote a random-weight SmolLM2-shaped checkpoint to {out}")
    return 0


def cmd_check(args) -> int:
    device = torch.device(args.device)
    acc = "CUDA" if device.type == "cuda" else f"[{device.type}]"  # non-CUDA: a dry run
    if device.type == "cuda":
        log(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {torch.cuda.get_device_name(device)}")
    ref = json.loads(Path(args.reference).read_text()) if args.reference else None
    ok = True
    if ref:
        prompts, num_tokens = ref["prompts"], min(args.num_tokens, ref["num_tokens"])
        here = weight_digest(args.model)
        same = here["__all__"] == ref["weights"]["__all__"]
        differing = [k for k in ref["weights"] if k != "__all__" and here.get(k) != ref["weights"][k]]
        log(f"weights: digest {here['__all__'][:16]} here vs {ref['weights']['__all__'][:16]} in the "
            f"reference -> {'IDENTICAL tensors' if same else f'{len(differing)} tensors differ'}"
            + (f" (e.g. {differing[:3]})" if differing else ""))
        ok &= same
        ref_tokens = [t[:num_tokens] for t in ref["tokens"]]
        ref_margins = ref["fp32_margins"]
        log(f"reference: CPU fp32 greedy tokens carried from the dev machine ({ref['made_with']})")
    else:
        prompts, num_tokens = prompt_ids(args.model), args.num_tokens
        ref_tokens, ref_margins = None, None

    runs: dict[str, list[list[int]]] = {}
    timing = {}
    for name, dev, dtype in (("CPU fp32 (this machine)", "cpu", "float32"),
                             (f"{acc} fp32", args.device, "float32"),
                             (f"{acc} bf16", args.device, "bfloat16")):
        runs[name], timing[name] = engine_greedy(args.model, prompts, num_tokens, dev, dtype)
    if not args.skip_hf:
        runs[f"HF {acc} bf16"] = hf_greedy(args.model, prompts, num_tokens, args.device, torch.bfloat16)

    if ref_tokens is None:
        ref_tokens = runs["CPU fp32 (this machine)"]
        cpu_model, _ = load_model(args.model, torch.float32, "cpu")
        ref_margins = [margins(teacher_forced_logits(cpu_model, p, t, torch.device("cpu")))
                       for p, t in zip(prompts, ref_tokens)]
        del cpu_model
        log("reference: CPU fp32 greedy tokens of this machine (no carried reference)")

    bf16_model = None
    log(f"\ngreedy tokens vs the CPU fp32 reference ({len(prompts)} prompts x {num_tokens} tokens):")
    for name, outs in runs.items():
        for i, (p, ours, want) in enumerate(zip(prompts, outs, ref_tokens)):
            d = first_divergence(ours, want)
            if d is None:
                log(f"  {name:<24} prompt {i}: all {num_tokens} tokens equal")
                continue
            line = (f"  {name:<24} prompt {i}: first divergence at token {d} "
                    f"(ref {want[d]}, got {ours[d]}); fp32 margin there {ref_margins[i][d]:.4f}")
            if name.endswith("bf16"):
                if bf16_model is None:
                    bf16_model, _ = load_model(args.model, torch.bfloat16, device)
                lg = teacher_forced_logits(bf16_model, p, want[:d + 1], device)[d]
                line += (f"; bf16 logits on the reference prefix: ref token {lg[want[d]]:.4f}, "
                         f"bf16 top-1 {int(lg.argmax())} {lg.max():.4f} "
                         f"(prefers it by {lg.max() - lg[want[d]]:.4f})")
            elif name == f"{acc} fp32" and ref_margins[i][d] >= 1e-2:
                ok = False
            elif name.startswith("CPU fp32") and ref is not None and ref_margins[i][d] >= 1e-2:
                ok = False
            log(line)
    for name, seconds in timing.items():
        log(f"  ({name}: {len(prompts)} requests in flight, {num_tokens} tokens each, "
            f"{seconds:.2f} s incl. prefill)")
    if runs.get(f"HF {acc} bf16"):
        agree = sum(a == b for a, b in zip(runs[f"HF {acc} bf16"], runs[f"{acc} bf16"]))
        log(f"  ours {acc} bf16 vs HF {acc} bf16: {agree}/{len(prompts)} prompts identical")

    if device.type == "cuda":
        log("\nhost-sync audit (torch.cuda.set_sync_debug_mode('warn'), CUDA bf16):")
        for line in sync_audit(args.model, prompts[0]):
            log(f"  {line}")
        if args.profile:
            log("\nCUDA bf16 decode step profile:")
            for batch in (1, 32):
                for line in profile_decode(args.model, prompts[0], batch):
                    log(f"  {line}")
    log(f"\nRESULT: {'PASS' if ok else 'FAIL'} (CUDA fp32 vs CPU fp32"
        f"{' and weight digest' if ref else ''}; bf16 differences are reported, not failed)")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("reference")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--num-tokens", type=int, default=20)
    p = sub.add_parser("check")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--reference", default=None)
    p.add_argument("--num-tokens", type=int, default=20)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="cuda", help="cuda[:N]; cpu only as a dry run of the script")
    p.add_argument("--profile", action="store_true", help="also profile a CUDA decode step")
    p = sub.add_parser("random-model")
    p.add_argument("--out", required=True)
    args = parser.parse_args()
    return {"reference": cmd_reference, "check": cmd_check, "random-model": cmd_random_model}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""FP8 GEMMs on the GPU, alone: are they right, and how fast are they against bf16?

    python3 bench/fp8_gemm_probe.py                  # Llama-3.1-8B layer shapes, M = 1 ... 4096

1. Correctness: `Fp8Linear`'s CUDA path against the same FP8 values dequantized and multiplied
   in fp64, for per-tensor and per-channel weights, static and per-token activations, bf16 and
   fp32 outputs: relative error per case.
2. Speed, per layer (q/k/v, o, gate/up, down of one 8B layer, summed), CUDA-graph replays timed
   with events: bf16 `x @ w.t()`, each FP8 GEMM alone, and `Fp8Linear` with the activation's
   quantization (what a projection costs in a step), against bf16 and the bandwidth floor.
"""

from __future__ import annotations

import argparse

import torch

from inflight.model.quantization import Fp8Linear, Fp8Scheme, fp8, linear

DEFAULT_ROWS_UNIT_SCALES = linear.MAX_ROWS_UNIT_SCALES

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (N, K): qkv, o, gate_up, down


def check(device: torch.device) -> None:
    torch.manual_seed(0)
    for weights, activations in (("channel", "token"), ("tensor", "static"), ("channel", "static"), ("tensor", "token")):
        for dtype in (torch.float32, torch.bfloat16):
            layer = Fp8Linear(256, 384, True, Fp8Scheme(weights, activations)).to(device)
            w = torch.randn(384, 256, device=device) * 0.05
            if weights == "channel":
                q, scale = fp8.quantize_weight_per_channel(w)
            else:
                scale = w.abs().amax() / fp8.FP8_MAX
                q = fp8.to_fp8(w, scale).to(device)
                scale = scale.reshape(1)
            layer.weight = torch.nn.Parameter(q, requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(scale.float(), requires_grad=False)
            if activations == "static":
                layer.input_scale = torch.nn.Parameter(torch.tensor([0.02], device=device), requires_grad=False)
            layer.bias = torch.nn.Parameter(torch.randn(384, device=device), requires_grad=False)
            layer.finalize(dtype)
            x = torch.randn(37, 256, device=device, dtype=dtype)
            out = layer(x).double()
            xq = fp8.fake_quantize(x, activations, getattr(layer, "input_scale", None)).double()
            ref = xq @ fp8.dequantize_weight(layer.weight, layer.weight_scale, weights).double().t() + layer.bias.double()
            err = float((out - ref).norm() / ref.norm())
            print(f"check weights {weights:7} activations {activations:6} out {str(dtype):15} "
                  f"scaled_mm {layer.scale_b is not None}: relative error {err:.2e}", flush=True)


def time_ms(fn, device, iters: int = 50) -> float:
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def speed(device: torch.device, ms: list[int]) -> None:
    """Per 8B layer (its four projections summed): bf16; cuBLASLt's FP8 GEMM alone, with
    row-wise scales and with unit scales into fp32; and `Fp8Linear` as a step runs it (the
    Triton quantization, then the GEMM) both ways: the scales in the GEMM, or applied after a
    unit-scale one (`scale_output`). The floor is the layer's bytes (FP8 weights, bf16
    activations) at the copy bandwidth."""
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print("| M | bf16 ms | row-wise GEMM ms | unit-scale GEMM ms | Fp8Linear row-wise ms "
          "| Fp8Linear unit scales ms | FP8 floor ms | best Fp8Linear / bf16 speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    one = torch.ones((), device=device)
    for m in ms:
        tb = tf = tt = t_row = t_unit = floor = 0.0
        for n, k in SHAPES_8B:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            layer = _layer_from(w)
            xq, xs = fp8.quantize_per_token(x)
            tb += time_ms(lambda: x @ w.t(), device)
            tf += time_ms(lambda: torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.scale_b,
                                                   out_dtype=torch.bfloat16), device)
            tt += time_ms(lambda: torch._scaled_mm(xq, layer.weight.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.float32), device)
            for rows_unit, name in ((0, "row"), (1 << 30, "unit")):
                linear.MAX_ROWS_UNIT_SCALES = rows_unit
                elapsed = time_ms(lambda: layer(x), device)
                t_row, t_unit = (t_row + elapsed, t_unit) if name == "row" else (t_row, t_unit + elapsed)
            floor += (n * k + 2 * m * (n + k)) / bandwidth * 1e3
        linear.MAX_ROWS_UNIT_SCALES = DEFAULT_ROWS_UNIT_SCALES
        print(f"| {m} | {tb:.3f} | {tf:.3f} | {tt:.3f} | {t_row:.3f} | {t_unit:.3f} | {floor:.3f} "
              f"| {tb / min(t_row, t_unit):.2f} |", flush=True)


def _layer_from(w: torch.Tensor) -> Fp8Linear:
    """An `Fp8Linear` (per-channel weights, per-token activations) holding w quantized."""
    layer = Fp8Linear(w.shape[1], w.shape[0], False, Fp8Scheme("channel", "token")).to(w.device)
    q, scale = fp8.quantize_weight_per_channel(w)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    layer.finalize(w.dtype)
    return layer


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (time_ms(lambda: dst.copy_(src), device, iters=10) / 1e3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ms", nargs="*", type=int, default=[1, 8, 32, 64, 128, 256, 512, 1024, 4096])
    args = parser.parse_args()
    device = torch.device("cuda")
    print(torch.cuda.get_device_name(device), torch.__version__, flush=True)
    check(device)
    speed(device, args.ms)

    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""FP8 on CUDA computes what the CPU path computes (tests/model/test_fp8_checkpoints.py).

On CUDA a projection quantizes its input with a Triton kernel and multiplies the FP8 values with
cuBLASLt (`torch._scaled_mm`; up to MAX_ROWS_UNIT_SCALES rows with unit scales into fp32 and
the scales applied by a Triton kernel); on the CPU it dequantizes its weight and fake-quantizes
its input. Same FP8 values in both, so a layer is
checked against the exact (fp64) product of those values. Whole-model logits are not compared:
in a random tiny model a 1e-4 change of one activation flips the rounding of the next layer's
e4m3 inputs, and the flips cascade (7 % of the logits' size after three layers on an H100),
so the model is checked by its greedy tokens instead, through the engine with CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig, ExtendedRuntimePerfKnobConfig, KvCacheConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.model.quantization import Fp8Linear, Fp8Scheme, fp8
from inflight.model.quantization.linear import MAX_ROWS_UNIT_SCALES
from tests.model import fp8_checkpoints as ckpt
from tests.model.engine_utils import DEFAULT_KV, RecordLogits, gen_request, output_tokens, run
from tests.model.test_fp8_checkpoints import E4M3_STEP, PROMPT
from tests.model.tolerances import assert_same_tokens_but_at_a_tie

# Hopper's FP8 tensor cores keep about 14 significant bits while accumulating (DeepSeek-V3's
# measurement on H800; an H100 showed 8e-5 relative over K = 256), so cuBLASLt's FP8 GEMM is
# allowed 2^-10 of the output's size.
ACCUMULATION = 2.0 ** -10
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8_cuda")
    (base / "modelopt").mkdir()
    (base / "plain").mkdir()
    ckpt.tiny_llama().save_pretrained(base / "plain")
    return {"modelopt": ckpt.save_modelopt(base / "modelopt"), "plain": base / "plain"}


def _layer(weights: str, activations: str, dtype: torch.dtype, in_features=512, out_features=384):
    torch.manual_seed(0)
    layer = Fp8Linear(in_features, out_features, True, Fp8Scheme(weights, activations)).to("cuda")
    w = torch.randn(out_features, in_features, device="cuda") * 0.05
    if weights == "channel":
        q, scale = fp8.quantize_weight_per_channel(w)
    else:
        scale = (w.abs().amax() / fp8.FP8_MAX).reshape(1)
        q = fp8.to_fp8(w, scale)
    layer.weight = torch.nn.Parameter(q, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale.float(), requires_grad=False)
    if activations == "static":
        layer.input_scale = torch.nn.Parameter(torch.tensor([0.01], device="cuda"), requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(out_features, device="cuda"), requires_grad=False)
    layer.finalize(dtype)
    assert layer.scale_b is not None and layer.dequantized is None  # the fast path
    return layer


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights, activations", [("channel", "token"), ("tensor", "static"),
                                                  ("channel", "static"), ("tensor", "token")])
@pytest.mark.parametrize("rows", [1, 37, MAX_ROWS_UNIT_SCALES, MAX_ROWS_UNIT_SCALES + 1, 300])
def test_projection_matches_the_exact_product_of_its_fp8_values(dtype, weights, activations, rows):
    layer = _layer(weights, activations, dtype)
    x = torch.randn(rows, layer.in_features, device="cuda", dtype=dtype) * 2
    out = layer(x).double()
    xq = fp8.fake_quantize(x, activations, getattr(layer, "input_scale", None)).double()
    w = fp8.dequantize_weight(layer.weight, layer.weight_scale, weights).double()
    exact = xq @ w.t() + layer.bias.double()
    relative = float((out - exact).norm() / exact.norm())
    # The accumulation, the output's rounding, and the bias added after it (one more rounding).
    assert relative <= ACCUMULATION + 2 * UNIT_ROUNDOFF[dtype], relative


def test_engine_with_graphs_and_triton_kernels_gives_the_cpu_engines_tokens(folders):
    """The whole engine on CUDA (Triton kernels, CUDA graphs with the FP8 projections captured,
    overlapped steps), fp32 around the FP8 projections, against the CPU engine's greedy tokens:
    they part only at a near tie (the reference's top-2 margin within one e4m3 step)."""
    prompts = [PROMPT, [1, 5, 9], list(range(3, 30))]
    recorders = [RecordLogits() for _ in prompts]
    cpu = LLMEngine.from_dir(folders["plain"], ExecutorConfig(device="cpu", dtype="float32",
                                                              kv_cache_config=DEFAULT_KV, quantization="fp8"))
    refs = [output_tokens(r) for r in run(cpu, [gen_request(p, 12, logits_processor=rec)
                                                for p, rec in zip(prompts, recorders)])]
    config = ExecutorConfig(device="cuda", dtype="float32", kv_cache_config=DEFAULT_KV, quantization="fp8",
                            extended_runtime_perf_knob_config=ExtendedRuntimePerfKnobConfig(cuda_graph_mode=True))
    cuda = LLMEngine.from_dir(folders["plain"], config)
    assert cuda.worker.graph_runner is not None
    for ref, rec, responses in zip(refs, recorders, run(cuda, [gen_request(p, 12) for p in prompts])):
        assert_same_tokens_but_at_a_tie(
            output_tokens(responses), ref, rec.logits,
            lambda logits: E4M3_STEP * float(logits.abs().max()))
    cuda.close()


def test_engine_with_an_fp8_kv_cache_and_graphs_decodes_the_rounded_values(folders, monkeypatch):
    """kv_cache_dtype fp8 on CUDA (store, decode, prefill and mixed kernels, CUDA graphs)
    against the same engine whose fp32 cache gets K/V rounded through e4m3: the same values,
    so greedy tokens part only at a tie within fp32 noise."""
    from tests.model.test_fp8_kv_cache import fake_quantize_writes
    from tests.model.tolerances import fp32_noise_bound

    prompts = [PROMPT, [1, 5, 9], list(range(3, 30))]
    graphs = ExtendedRuntimePerfKnobConfig(cuda_graph_mode=True)

    def engine(kv_dtype):
        kv = KvCacheConfig(max_tokens=4096, tokens_per_block=16, dtype=kv_dtype)
        return LLMEngine.from_dir(folders["plain"], ExecutorConfig(
            device="cuda", dtype="float32", kv_cache_config=kv, extended_runtime_perf_knob_config=graphs))

    recorders = [RecordLogits() for _ in prompts]
    with monkeypatch.context() as patch:
        fake_quantize_writes(patch, "triton")
        reference = engine("auto")
        refs = [output_tokens(r) for r in run(reference, [gen_request(p, 12, logits_processor=rec)
                                                           for p, rec in zip(prompts, recorders)])]
        reference.close()
    fp8_engine = engine("fp8")
    assert fp8_engine.worker.kv_caches[0].dtype == torch.float8_e4m3fn
    for ref, rec, responses in zip(refs, recorders, run(fp8_engine, [gen_request(p, 12) for p in prompts])):
        assert_same_tokens_but_at_a_tie(
            output_tokens(responses), ref, rec.logits,
            lambda logits: 2 * fp32_noise_bound(3, 64, float(logits.abs().max())))
    fp8_engine.close()

"""4-bit weights (W4A16) on CUDA compute what the CPU path computes
(tests/model/test_int4_checkpoints.py).

On CUDA a projection keeps the packed words and multiplies them with the Triton kernel
(`inflight/kernels/int4.py`: CUDA cores at one row, tensor cores above, split-K for few output
tiles), or from `use_dequantize` rows dequantizes into the shared buffer and calls cuBLAS; on
the CPU it dequantizes its weight at load. The weights are exact in both, so a layer is checked
against the exact (fp64) product, and the engine (CUDA graphs, fp32) by its greedy tokens
against the CPU engine's.
"""

from __future__ import annotations

import pytest
import torch

from inflight.api.config import ExecutorConfig, ExtendedRuntimePerfKnobConfig
from inflight.engine.llm_engine import LLMEngine
from inflight.model.quantization import Int4Linear, Int4Scheme, int4
from inflight.model.quantization.int4_linear import share_dequantization_buffer
from tests.model import fp8_checkpoints as ckpt
from tests.model.engine_utils import DEFAULT_KV, RecordLogits, gen_request, output_tokens, run
from tests.model.test_fp8_checkpoints import PROMPT
from tests.model.tolerances import assert_same_tokens_but_at_a_tie, fp32_noise_bound

UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}


def _layer(symmetric: bool, dtype: torch.dtype, in_features=1024, out_features=384, group=128):
    torch.manual_seed(0)
    scheme = Int4Scheme(group, symmetric)
    layer = Int4Linear(in_features, out_features, True, scheme).to("cuda")
    q = torch.randint(-8, 8, (out_features, in_features), dtype=torch.int8, device="cuda")
    groups = in_features // group
    scale = (torch.rand(out_features, groups, device="cuda") * 0.02 + 0.001).to(torch.bfloat16).float()
    zero = torch.randint(-8, 8, (out_features, groups), dtype=torch.int8, device="cuda")
    layer.weight_packed = torch.nn.Parameter(int4.pack(q), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
    if not symmetric:
        layer.weight_zero_point = torch.nn.Parameter(int4.pack(zero.t().contiguous()).t().contiguous(),
                                                     requires_grad=False)
    layer.weight_shape = torch.nn.Parameter(torch.tensor([[out_features, in_features]], device="cuda"),
                                            requires_grad=False)
    layer.bias = torch.nn.Parameter(torch.randn(out_features, device="cuda"), requires_grad=False)
    exact = int4.dequantize(layer.weight_packed, scale, None if symmetric else zero, in_features).double()
    layer.finalize(dtype)
    assert layer.kernel_weight is not None and layer.dequantized is None  # the packed path
    share_dequantization_buffer(torch.nn.Sequential(layer), dtype)
    return layer, exact


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("rows", [1, 2, 16, 37, 64, 300, 1100])
def test_projection_matches_the_exact_product_of_its_4_bit_values(dtype, symmetric, rows):
    # (inflight.kernels is imported by the tests alone: importing it at collection, before
    # tests/kernels turns the CPU interpreter on, breaks the interpreted kernels.)
    from inflight.kernels import int4 as int4_kernels

    assert int4_kernels.use_dequantize(300) and not int4_kernels.use_dequantize(64)  # both paths run
    layer, w = _layer(symmetric, dtype)
    x = torch.randn(rows, layer.in_features, device="cuda", dtype=dtype)
    out = layer(x).double()
    exact = x.double() @ w.t() + layer.bias.double()
    # Each weight rounded once to the activation dtype (the dequantized paths), fp32 accumulation
    # over K, the output's rounding and the bias added after it: u (|x| |w|^T + 2 |exact|) + K u32.
    u = UNIT_ROUNDOFF[dtype]
    magnitude = x.double().abs() @ w.abs().t()
    bound = u * (magnitude + 2 * exact.abs()) + layer.in_features * 2.0 ** -24 * magnitude
    excess = (out - exact).abs() - bound
    assert float(excess.max()) <= 0, float(((out - exact).abs() / bound).max())


def _asymmetric_folder(path, group: int = 32):
    """The tiny model as an asymmetric 4-bit pack-quantized folder, packed with `int4.pack`
    (equal to compressed-tensors' packing, tests/model/test_int4_checkpoints.py; the GPU image
    lacks that package)."""
    import json

    from safetensors.torch import save_file

    model = ckpt.tiny_llama()
    model.save_pretrained(path)
    tensors = {}
    for name, value in model.state_dict().items():
        if not (name.endswith("_proj.weight") and ".layers." in name):
            tensors[name] = value.contiguous()
            continue
        grouped = value.float().unflatten(1, (-1, group))  # [N, K / G, G]
        low, high = grouped.amin(2).clamp(max=0), grouped.amax(2).clamp(min=0)
        scale = ((high - low) / 15).clamp_min(1e-6).to(torch.bfloat16).float()
        zero = (-8 - (low / scale).round()).clamp(-8, 7)
        q = ((grouped / scale.unsqueeze(2)).round() + zero.unsqueeze(2)).clamp(-8, 7).flatten(1)
        prefix = name.removesuffix(".weight")
        tensors[f"{prefix}.weight_packed"] = int4.pack(q.to(torch.int8))
        tensors[f"{prefix}.weight_scale"] = scale.to(torch.bfloat16)
        tensors[f"{prefix}.weight_zero_point"] = int4.pack(zero.to(torch.int8).t().contiguous()).t().contiguous()
        tensors[f"{prefix}.weight_shape"] = torch.tensor(value.shape)
    for old in path.glob("*.safetensors"):
        old.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": group}}}}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_engine_with_graphs_gives_the_cpu_engines_tokens(tmp_path):
    """The whole engine on CUDA (Triton kernels, CUDA graphs with the 4-bit projections
    captured, overlapped steps), fp32, against the CPU engine's greedy tokens on the same folder:
    the same function, so they part only at a tie within fp32 noise."""
    folder = _asymmetric_folder(tmp_path)
    prompts = [PROMPT, [1, 5, 9], list(range(3, 30))]
    recorders = [RecordLogits() for _ in prompts]
    cpu = LLMEngine.from_dir(folder, ExecutorConfig(device="cpu", dtype="float32", kv_cache_config=DEFAULT_KV))
    refs = [output_tokens(r) for r in run(cpu, [gen_request(p, 12, logits_processor=rec)
                                                for p, rec in zip(prompts, recorders)])]
    config = ExecutorConfig(device="cuda", dtype="float32", kv_cache_config=DEFAULT_KV,
                            extended_runtime_perf_knob_config=ExtendedRuntimePerfKnobConfig(cuda_graph_mode=True))
    cuda = LLMEngine.from_dir(folder, config)
    assert cuda.worker.graph_runner is not None
    assert isinstance(cuda.worker.model.model.layers[0].self_attn.qkv_proj, Int4Linear)
    for ref, rec, responses in zip(refs, recorders, run(cuda, [gen_request(p, 12) for p in prompts])):
        assert_same_tokens_but_at_a_tie(
            output_tokens(responses), ref, rec.logits,
            lambda logits: 2 * fp32_noise_bound(3, 128, logits.abs().max().item()))
    cuda.close()

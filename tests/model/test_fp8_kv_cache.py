"""`kv_cache_dtype: fp8`: K/V stored in e4m3 on the CPU (the torch backend) and through the
Triton kernels (the interpreter here), scaled by the checkpoint's k_scale / v_scale where it
has them.

The reference is the fp32 cache holding K and V rounded through e4m3 (`fake_quantized_writes`):
the FP8 cache must compute the same attention over the same values, differing only in the
order of float operations (its scales fold into the softmax scale and the output), so the fp32
noise bound of `tolerances.py` applies. What the rounding itself costs is not bounded here: in
this random tiny model the attention is near one-hot (scores of tens), and half an e4m3 step
on a key (2^-4 of it) moves the logits by 12 % of their size; `checks/fp8_perplexity.py`
measures it on a real model. Capacity: the same memory holds element-size-ratio times the
blocks.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from inflight.api.config import KvCacheConfig  # noqa: E402
from inflight.model.config import ModelConfig  # noqa: E402
from inflight.model.attention import AttentionLimits, StepMetadata  # noqa: E402
from inflight.model.loader import allocate_kv_caches, load_model  # noqa: E402
from tests.model import fp8_checkpoints as ckpt  # noqa: E402
from inflight.model.attention import torch_ref  # noqa: E402
from inflight.model.quantization import fp8  # noqa: E402
from tests.model.engine_utils import RecordLogits, gen_request, make_engine, output_tokens, run  # noqa: E402
from tests.model.test_fp8_checkpoints import PROMPT  # noqa: E402
from tests.model.tolerances import (  # noqa: E402
    assert_same_tokens_but_at_a_tie,
    fp32_noise_bound,
    logits_tolerance,
)

FP8_KV = torch.float8_e4m3fn
# The Triton kernels run compiled where there is CUDA, else under the interpreter on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8_kv")
    (base / "plain").mkdir()
    (base / "modelopt").mkdir()
    ckpt.tiny_llama().save_pretrained(base / "plain")
    return {"plain": base / "plain", "modelopt": ckpt.save_modelopt(base / "modelopt")}


def _round_through_e4m3(k, v, kv_scales):
    # A Python float scale: no host-to-device copy, which a CUDA graph's capture refuses.
    return (fp8.to_fp8(x.float(), float(scale)).float() * scale
            for x, scale in ((k, kv_scales[0]), (v, kv_scales[1])))


def fake_quantize_writes(patch, backend: str) -> None:
    """Makes `backend`'s fp32 cache get K and V rounded through e4m3 (with the layer's scales)
    and dequantized: the values an FP8 cache holds."""
    if backend == "torch":
        write = torch_ref.write_kv_cache

        def rounded(k, v, kv_cache, slot_mapping, kv_scales=(1.0, 1.0)):
            write(*_round_through_e4m3(k, v, kv_scales), kv_cache, slot_mapping)
        patch.setattr(torch_ref, "write_kv_cache", rounded)
    else:
        from inflight import kernels

        store = kernels.store_kv_cache

        def rounded(k, v, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
            store(*_round_through_e4m3(k, v, (k_scale, v_scale)), kv_cache, slot_mapping)
        patch.setattr(kernels, "store_kv_cache", rounded)


@pytest.fixture
def fake_quantized_writes(monkeypatch):
    fake_quantize_writes(monkeypatch, "torch")


def _logits(folder, backend: str, kv_dtype: torch.dtype) -> torch.Tensor:
    """Logits of a prefill of PROMPT's first half, then of its second half as a chunk that
    reads the first half back from the cache (so the cached K/V are what it attends over)."""
    model, config = load_model(folder, torch.float32, DEVICE, backend)
    model.attention_backend.reserve(AttentionLimits(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, max_num_seqs=2,
        max_seq_len=64, device=DEVICE))
    caches = allocate_kv_caches(config, 8, 16, kv_dtype, DEVICE)
    half = len(PROMPT) // 2
    out = []
    with torch.no_grad():
        for start, ids in ((0, PROMPT[:half]), (half, PROMPT[half:])):
            meta = StepMetadata.build([(start, len(ids), [0])], 16, DEVICE, input_ids=ids)
            hidden = model(meta.input_ids, meta.positions, caches, model.attention_backend.build_metadata(meta))
            out.append(model.compute_logits(hidden).cpu())
    return torch.cat(out)


def _fake_quantized_logits(folder, backend: str, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        fake_quantize_writes(patch, backend)
        return _logits(folder, backend, torch.float32)


def _tolerance(logits: torch.Tensor) -> dict[str, float]:
    config = ckpt.TINY_COMMON
    return logits_tolerance(logits, config["num_hidden_layers"], config["hidden_size"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("which", ["plain", "modelopt"])
def test_fp8_cache_attends_over_the_rounded_values(folders, backend, which, monkeypatch):
    if backend == "triton":
        pytest.importorskip("triton")
    # Against the same backend: FP8 activations (the ModelOpt checkpoint) would turn the two
    # backends' fp32 noise into e4m3 rounding flips.
    expected = _fake_quantized_logits(folders[which], backend, monkeypatch)
    torch.testing.assert_close(_logits(folders[which], backend, FP8_KV), expected, **_tolerance(expected))


def test_checkpoint_kv_scales_are_read(folders):
    model, _ = load_model(folders["modelopt"], torch.float32, "cpu")
    fp32 = torch.tensor([0.05, 0.04]).tolist()  # the checkpoint's fp32 values
    assert {layer.self_attn.kv_scales for layer in model.model.layers} == {tuple(fp32)}
    plain, _ = load_model(folders["plain"], torch.float32, "cpu")
    assert {layer.self_attn.kv_scales for layer in plain.model.layers} == {(1.0, 1.0)}


def test_engine_with_an_fp8_cache_holds_more_and_decodes_the_rounded_values(folders, fake_quantized_writes):
    fp32_block_bytes = ModelConfig.from_dir(folders["plain"]).kv_bytes_per_token(torch.float32) * 16
    engines = {dtype: make_engine(folders["plain"], kv_cache_config=KvCacheConfig(
        host_memory_bytes=100 * fp32_block_bytes, tokens_per_block=16, dtype=dtype))
        for dtype in ("auto", "fp8")}
    # An fp32 model: 4 bytes an element against 1.
    assert (engines["auto"].worker.num_blocks, engines["fp8"].worker.num_blocks) == (100, 400)
    assert engines["fp8"].worker.kv_caches[0].dtype == FP8_KV
    prompts = [PROMPT, [1, 5, 9], list(range(3, 30))]
    recorders = [RecordLogits() for _ in prompts]
    # The fp32 engine writes rounded values (the fixture); the FP8 engine stores the e4m3 bits.
    refs = [output_tokens(r) for r in run(engines["auto"], [gen_request(p, 10, logits_processor=rec)
                                                            for p, rec in zip(prompts, recorders)])]
    config = ckpt.TINY_COMMON
    for ref, rec, responses in zip(refs, recorders, run(engines["fp8"], [gen_request(p, 10) for p in prompts])):
        assert_same_tokens_but_at_a_tie(
            output_tokens(responses), ref, rec.logits,
            lambda logits: 2 * fp32_noise_bound(config["num_hidden_layers"], config["hidden_size"],
                                                logits.abs().max().item()))


def test_kv_cache_dtype_is_checked():
    with pytest.raises(Exception, match="kv_cache_dtype must be auto or fp8, got 'int8'"):
        KvCacheConfig(dtype="int8")

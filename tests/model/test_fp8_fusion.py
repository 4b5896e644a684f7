"""The FP8 projections' CUDA path, and its input quantization fused into the norm and SiLU-mul
kernels, run on the CPU: `torch._scaled_mm` runs there too, and the Triton kernels run under
the interpreter. Fusing moves work between kernels and changes no value, so the fused model's
logits equal the unfused model's bit for bit (tests/gpu/test_fp8_cuda.py checks the same on a
GPU, and the tokens against the CPU path's)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from inflight.model.attention import AttentionLimits, StepMetadata  # noqa: E402
from inflight.model import loader  # noqa: E402
from inflight.model.loader import allocate_kv_caches, load_model  # noqa: E402
from inflight.model.quantization import linear  # noqa: E402
from inflight.model.quantization.fusion import Fp8OutputRMSNorm, Fp8OutputSiluAndMul  # noqa: E402
from tests.model import fp8_checkpoints as ckpt  # noqa: E402
from tests.model.test_fp8_checkpoints import PROMPT  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("fp8_fusion")
    (base / "plain").mkdir()
    (base / "modelopt").mkdir()
    ckpt.tiny_llama().save_pretrained(base / "plain")
    return {"plain": base / "plain", "modelopt": ckpt.save_modelopt(base / "modelopt")}


def _logits(folder, quantization, fused: bool, monkeypatch) -> tuple[torch.Tensor, torch.nn.Module]:
    monkeypatch.setattr(linear, "_computes_in_fp8", lambda weight: True)
    if not fused:
        monkeypatch.setattr(loader, "fuse_input_quantization", lambda model, dtype: 0)
    model, config = load_model(folder, torch.float32, DEVICE, "triton", quantization=quantization)
    monkeypatch.undo()
    model.attention_backend.reserve(AttentionLimits(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, max_num_seqs=2,
        max_seq_len=64, device=DEVICE))
    caches = allocate_kv_caches(config, 8, 16, torch.float32, DEVICE)
    meta = StepMetadata.build([(0, len(PROMPT), list(range(8)))], 16, DEVICE, input_ids=PROMPT)
    with torch.no_grad():
        hidden = model(meta.input_ids, meta.positions, caches, model.attention_backend.build_metadata(meta))
        return model.compute_logits(hidden), model


@pytest.mark.parametrize("which, quantization", [("plain", "fp8"), ("modelopt", None)])
def test_fused_input_quantization_changes_no_value(folders, which, quantization, monkeypatch):
    fused, model = _logits(folders[which], quantization, True, monkeypatch)
    layers = len(model.model.layers)
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(Fp8OutputRMSNorm) == 2 * layers and kinds.count(Fp8OutputSiluAndMul) == layers
    # cuBLASLt refuses scale pointers that are not 16-byte aligned (a packed layer's merged
    # per-tensor scale was once a view at an offset); the CPU's _scaled_mm does not check.
    assert all(m.scale_b.data_ptr() % 16 == 0 for m in model.modules() if isinstance(m, linear.Fp8Linear))
    unfused, model = _logits(folders[which], quantization, False, monkeypatch)
    assert Fp8OutputRMSNorm not in {type(m) for m in model.modules()}
    assert torch.equal(fused, unfused)


def test_nothing_is_fused_with_the_torch_ops(folders, monkeypatch):
    """The torch ops are the reference arithmetic: the projections still take FP8, the norms
    and activations stay torch's."""
    monkeypatch.setattr(linear, "_computes_in_fp8", lambda weight: True)
    model, _ = load_model(folders["plain"], torch.float32, DEVICE, "torch", quantization="fp8")
    assert any(isinstance(m, linear.Fp8Linear) and m.takes_quantized_input for m in model.modules())
    assert not any(isinstance(m, (Fp8OutputRMSNorm, Fp8OutputSiluAndMul)) for m in model.modules())

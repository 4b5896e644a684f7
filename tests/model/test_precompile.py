"""Start-up precompilation covers every Triton kernel variant a workload asks for.

On the CPU the kernels run under Triton's interpreter, which compiles nothing; what is checked
is the specialization key each launch would compile on a GPU (`jit_stats.specialization_key`,
computed as Triton's binder does): after `precompile`, a mixed workload (one row and several,
odd and even token counts, chunked prefill, decode rows of several split-K classes, greedy and
sampled rows) asks for no key that start-up did not. checks/gpu_startup_check.py counts the
real compiles on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from inflight.api.config import KvCacheConfig  # noqa: E402
from inflight.api.types import SamplingConfig  # noqa: E402
from inflight.kernels.jit_stats import LaunchRecorder  # noqa: E402
from inflight.model.attention import AttentionLimits  # noqa: E402
from inflight.model.loader import load_model  # noqa: E402
from inflight.runner.precompile import precompile, step_kinds  # noqa: E402
from tools.checkpoints import LLAMA3_ROPE, TINY_COMMON  # noqa: E402
from tests.model.engine_utils import gen_request, make_engine, run  # noqa: E402


def _save_one_layer_llama3(path) -> None:
    """The tiny llama3 checkpoint with one layer. Every layer launches the same kernel variants
    (same shapes, strides and alignment), so one layer asks for every key that three would, in
    a third of the interpreter's time."""
    import transformers

    config = transformers.LlamaConfig(**{**TINY_COMMON, "num_hidden_layers": 1},
                                      rope_parameters=dict(LLAMA3_ROPE), attention_bias=True, mlp_bias=True)
    torch.manual_seed(1234)
    transformers.LlamaForCausalLM(config).save_pretrained(path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks/gpu_startup_check.py on CUDA")
def test_precompile_covers_every_variant_of_a_mixed_workload(tmp_path, monkeypatch):
    from inflight.kernels import paged_attention
    monkeypatch.setattr(paged_attention, "MIN_TOKENS_PER_PARTITION", 16)  # split-K at tiny lengths
    _save_one_layer_llama3(tmp_path)
    engine = make_engine(tmp_path, max_batch_size=4, max_num_tokens=16, max_seq_len=96,
                         enable_chunked_context=True,
                         kv_cache_config=KvCacheConfig(max_tokens=512, tokens_per_block=2))
    worker = engine.worker
    model, config = load_model(tmp_path, torch.float32, "cpu", "triton")
    model.attention_backend.reserve(AttentionLimits(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        max_num_seqs=4, max_seq_len=worker.max_seq_len, device=torch.device("cpu")))
    worker.model, worker.backend = model, model.attention_backend
    assert len(step_kinds(worker)) >= 4  # prefill, mixed, and several split-K classes

    with LaunchRecorder() as start_up:
        precompile(worker)
    sampled = SamplingConfig(temperature=0.7, top_k=20, seed=3)
    requests = [gen_request([7], 2, end_id=-1),  # a one-token prompt: its prefill is a decode
                gen_request(list(range(10, 27)), 3, end_id=-1),
                gen_request(list(range(30, 90)), 8, end_id=-1),  # chunked, then decodes split-K
                gen_request([5, 6, 8], 3, end_id=-1, sampling_config=sampled)]
    with LaunchRecorder() as serving:
        run(engine, requests)
        # Alone, a 32-token prompt is two 16-token chunks: the second's block tables are 16
        # entries wide (block size 2), a value class of its own had the kernels specialized it.
        run(engine, [gen_request(list(range(100, 132)), 1, end_id=-1)])
    assert serving.keys, "the workload launched no kernel"
    missing = serving.keys - start_up.keys
    assert not missing, f"variants first asked for while serving: {sorted(k for k, _ in missing)}"


@pytest.mark.parametrize("max_rows, max_tokens", [(1, 64), (2, 64), (4, 6), (64, 3)])
def test_step_kinds_fit_the_engines_own_limits(max_rows, max_tokens):
    """A step bigger than max_num_sequences or max_num_tokens overflows the worker's buffers:
    precompile once failed at start-up on a GPU for max_num_sequences 1 (its mixed step had 4
    rows). Every row type must still be met, in smaller steps."""
    from types import SimpleNamespace

    worker = SimpleNamespace(block_size=4, max_seq_len=96, backend=None,
                             max_batch_size=max_rows, max_num_tokens=max_tokens)
    kinds = step_kinds(worker)
    assert all(0 < len(kind) <= max_rows and sum(n for _, n in kind) <= max_tokens for kind in kinds)
    starts = {start for kind in kinds for start, _ in kind}
    assert starts >= {0, 4, 6}  # prefill rows, a chunk after cached tokens, a decode row

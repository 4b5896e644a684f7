"""The CUDA-graph runner's static inputs (decode and mixed steps): staging layout, padding rows
and tokens, tokens still on the device, the LM head into the shared logits buffer. Without
CUDA the runner runs the captured body eagerly over the same buffers (Triton kernels under the interpreter), which is what the
graph replays; with CUDA (checks/gpu_check.sh) the graphs are captured and replayed."""

from __future__ import annotations

import os

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")

pytest.importorskip("triton")

from inflight.model.attention import AttentionLimits, StepMetadata  # noqa: E402
from inflight.model.loader import allocate_kv_caches, load_model  # noqa: E402
from inflight.runner.cuda_graph import CudaGraphRunner, GraphStep, MixedStep, StaticLayout  # noqa: E402
from tools.checkpoints import save_tiny_checkpoint  # noqa: E402
from tests.model.tolerances import logits_tolerance  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
BLOCK = 8


def test_static_layout_aligns_every_field_and_holds_every_bucket():
    for max_batch, width in ((1, 1), (3, 5), (16, 4096), (33, 7)):
        layout = StaticLayout.for_buckets(max_batch, width)
        assert layout.rows >= max_batch and layout.rows % 16 == 0
        assert layout.i32_offset % 64 == 0 and layout.tables_offset % 64 == 0
        assert layout.nbytes == 40 * layout.rows + 4 * layout.rows * (1 + width)
        assert layout.step_nbytes(max_batch) <= layout.nbytes
        i64, seq_lens, tables = layout.split(torch.zeros(layout.nbytes, dtype=torch.uint8))
        assert i64.shape == (5, layout.rows) and seq_lens.shape == (layout.rows,)
        assert tables.shape == (layout.rows, width) and tables.stride() == (width, 1)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3")
    save_tiny_checkpoint("llama3", path)
    model, config = load_model(path, torch.float32, DEVICE, "triton")
    model.attention_backend.reserve(AttentionLimits(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, max_num_seqs=4,
        max_seq_len=config.max_position_embeddings, device=DEVICE))
    return model, config


def test_staged_decode_step_matches_the_eager_step(model):
    model, config = model
    caches = allocate_kv_caches(config, 24, BLOCK, torch.float32, DEVICE)
    tables = [[3, 17, 5], [9, 0, 22]]
    prompts = [list(range(10, 27)), list(range(40, 50))]
    for prompt, table in zip(prompts, tables):
        meta = StepMetadata.build([(0, len(prompt), table)], BLOCK, DEVICE, input_ids=prompt)
        model(meta.input_ids, meta.positions, caches, model.attention_backend.build_metadata(meta))
    saved = [c.clone() for c in caches]
    next_tokens = [123, 321]
    eager = StepMetadata.build([(len(p), 1, t) for p, t in zip(prompts, tables)], BLOCK, DEVICE,
                               input_ids=next_tokens)
    hidden = model(eager.input_ids, eager.positions, caches, model.attention_backend.build_metadata(eager))
    expected = model.compute_logits(hidden)

    sampled = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    sampled[3] = next_tokens[1]  # row 1's token is still "on the device": sampled row 3
    runner = CudaGraphRunner(model, (1, 4), config.max_position_embeddings, BLOCK, sampled, DEVICE)
    if ON_CUDA:
        runner.capture(caches)  # padded warm-up and capture store nothing in the cache
    else:
        runner.bind(caches)
    for cache, copy in zip(caches, saved):
        cache.copy_(copy)
    assert runner.bucket_for(2) == 4 and runner.bucket_for(5) is None
    rows = [(next_tokens[0], len(prompts[0]), tables[0]), (0, len(prompts[1]), tables[1])]
    for _ in range(2):  # the second replay reads the same inputs from a fresh staging buffer
        step = runner.stage(rows, pending=([1], [3]))
        assert (step.batch_size, step.num_rows, step.num_pending) == (4, 2, 1)
        logits = runner.replay(step)
        torch.testing.assert_close(logits, expected,
                                   **logits_tolerance(expected, config.num_hidden_layers, config.hidden_size))
    bucket = runner.buckets[4]
    assert bucket.slot_mapping[2:].tolist() == [-1, -1] and bucket.buffers.seq_lens[2:].tolist() == [0, 0]
    assert bucket.input_ids[:2].tolist() == next_tokens


@pytest.mark.skipif(ON_CUDA, reason="a CPU engine (interpreted kernels); checks/gpu_parity.py runs it on CUDA")
def test_engine_replays_decode_and_mixed_steps_through_the_runner(tmp_path_factory):
    """The worker's graph paths end to end, with overlap and staggered arrivals: decode steps
    replay decode buckets, a prompt beside decode rows replays a mixed bucket (a prompt too
    long for it runs eagerly), tokens still on the device come from the last sample; the
    outputs equal the synchronous torch engine's."""
    from tests.model.engine_utils import gen_request, make_engine

    path = tmp_path_factory.mktemp("llama3-engine")
    save_tiny_checkpoint("llama3", path)
    prompts = [[5, 9, 41, 7, 300], list(range(30, 52)), [400, 401, 3]]

    def staggered(engine):  # request i arrives at step 2 i
        outputs, step, waiting = {}, 0, list(prompts)
        while waiting or engine.has_unfinished():
            if waiting and step % 2 == 0:
                outputs[engine.add_request(gen_request(waiting.pop(0), 5, end_id=-1))] = []
            for r in engine.step():
                outputs[r.request_id] += r.result.output_token_ids[0]
            step += 1
        return list(outputs.values())

    expected = staggered(make_engine(path))
    engine = make_engine(path, enable_overlap_scheduler=True)
    worker = engine.worker
    model, config = load_model(path, torch.float32, "cpu", "triton")
    model.attention_backend.reserve(AttentionLimits(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        max_num_seqs=engine.config.max_batch_size, max_seq_len=worker.max_seq_len,
        device=torch.device("cpu")))
    worker.model, worker.backend = model, model.attention_backend
    runner = CudaGraphRunner(model, (1, 2, 4), worker.max_seq_len, worker.block_size,
                             worker.sampled_ids, torch.device("cpu"), mixed_token_buckets=(16,),
                             max_num_seqs=engine.config.max_batch_size)
    runner.bind(worker.kv_caches)
    worker.graph_runner = runner
    replays = []
    real_replay = runner.replay
    runner.replay = lambda step: replays.append(step) or real_replay(step)
    assert staggered(engine) == expected
    decode = [s for s in replays if isinstance(s, GraphStep)]
    mixed = [s for s in replays if isinstance(s, MixedStep)]
    assert len(decode) >= 4 and any(s.num_pending == s.num_rows == 2 for s in decode), \
        "overlapped steps read their tokens on the device"
    # The first prompt alone, then the third beside two decode rows; the second is too long.
    assert [(s.num_sampled, s.num_pending) for s in mixed] == [(1, 0), (3, 2)]


def test_staged_mixed_step_matches_the_eager_step(model):
    """A prompt, a chunk after cached tokens (not sampled) and a decode row whose token is
    still on the device, in one padded mixed bucket: the sampled rows' logits equal the eager
    step's, and only real tokens reach the cache."""
    model, config = model
    caches = allocate_kv_caches(config, 24, BLOCK, torch.float32, DEVICE)
    decode_prompt, chunk_prompt = list(range(10, 27)), list(range(60, 80))
    tables = [[3, 17, 5], [9, 0, 22], [11, 12]]
    for prompt, table, n in ((decode_prompt, tables[0], 17), (chunk_prompt, tables[1], 8)):
        meta = StepMetadata.build([(0, n, table)], BLOCK, DEVICE, input_ids=prompt[:n])
        model(meta.input_ids, meta.positions, caches, model.attention_backend.build_metadata(meta))
    saved = [c.clone() for c in caches]
    new_prompt = [7, 300, 41, 9, 2, 66]
    rows = [(17, [123], True, tables[0]), (8, chunk_prompt[8:13], False, tables[1]),
            (0, new_prompt, True, tables[2])]
    eager = StepMetadata.build([(s, len(t), table) for s, t, _, table in rows], BLOCK, DEVICE,
                               input_ids=[t for _, tokens, _, _ in rows for t in tokens],
                               sampled_rows=[0, 2])
    hidden = model(eager.input_ids, eager.positions, caches, model.attention_backend.build_metadata(eager))
    expected = model.compute_logits(hidden.index_select(0, eager.logits_indices))
    after_eager = [c.clone() for c in caches]

    sampled = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    sampled[2] = 123  # row 0's token is still "on the device": sampled row 2
    runner = CudaGraphRunner(model, (1, 4), config.max_position_embeddings, BLOCK, sampled, DEVICE,
                             mixed_token_buckets=(8, 16, 32), max_num_seqs=4)
    for cache, copy in zip(caches, saved):
        cache.copy_(copy)
    if ON_CUDA:
        runner.capture(caches)
    else:
        runner.bind(caches)
    for cache, copy in zip(caches, saved):
        cache.copy_(copy)
    assert runner.mixed_bucket_for(12, 3) == 16 and runner.mixed_bucket_for(33, 3) is None
    staged_rows = [(17, [-3], True, tables[0])] + rows[1:]
    for _ in range(2):  # the second replay reads the same inputs from a fresh staging buffer
        step = runner.stage_mixed(staged_rows)
        assert (step.num_tokens, step.num_sampled, step.num_pending) == (16, 2, 1)
        logits = runner.replay(step)
        torch.testing.assert_close(logits, expected,
                                   **logits_tolerance(expected, config.num_hidden_layers, config.hidden_size))
    for cache, want in zip(caches, after_eager):
        torch.testing.assert_close(cache, want, **logits_tolerance(want, config.num_hidden_layers,
                                                                    config.hidden_size))
    bucket = runner.mixed.buckets[16]
    assert bucket.slot_mapping[12:].tolist() == [-1] * 4
    assert bucket.buffers.query_start_loc.tolist() == [0, 1, 6, 12, 12, 16]
    assert bucket.buffers.seq_lens.tolist() == [18, 13, 6, 0, 0]
    assert bucket.logits_indices.tolist() == [0, 11, 0, 0]

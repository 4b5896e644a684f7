"""The Triton path (attention backend + fused ops) against the torch path, through the whole
tiny model, in fp32 on the CPU under Triton's interpreter (compiled where CUDA is present).

Both models load the same tiny random checkpoint; each scenario feeds both the same steps on
their own caches and compares every step's logits: a prefill batch, a chunked prefill after
cached prefix blocks (shared block tables), decode steps with split-K partitions, and a mixed
step (decode rows, a fresh prefill and a chunk), then a decode step through the CUDA-graph
metadata with padded rows.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
if not ON_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

pytest.importorskip("triton")
# The 3.6 interpreter converts 1-element arrays to ints through a numpy deprecation path.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

from inflight.model.attention import AttentionLimits, DecodeBuffers, StepMetadata  # noqa: E402
from inflight.model.loader import allocate_kv_caches, load_model  # noqa: E402
from tests.model.tolerances import logits_tolerance  # noqa: E402
from tools.checkpoints import TINY_COMMON, save_tiny_checkpoint  # noqa: E402

BLOCK_SIZE = 8
NUM_BLOCKS = 48
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
@pytest.fixture(scope="module", params=["llama3", "mistral"])
def models(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save_tiny_checkpoint(request.param, path)
    torch_model, config = load_model(path, torch.float32, DEVICE, "torch")
    triton_model, _ = load_model(path, torch.float32, DEVICE, "triton")
    triton_model.attention_backend.reserve(AttentionLimits(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, max_num_seqs=4,
        max_seq_len=config.max_position_embeddings, device=DEVICE))
    return torch_model, triton_model, config


@pytest.fixture
def split_k(monkeypatch):
    """Short partitions, so the tiny contexts here split into several (as 8k contexts do)."""
    from inflight.kernels import paged_attention
    monkeypatch.setattr(paged_attention, "MIN_TOKENS_PER_PARTITION", 16)


class Pair:
    """The two models, each with its own cache, stepped together."""

    def __init__(self, models):
        self.torch_model, self.triton_model, self.config = models
        self.caches = {m: allocate_kv_caches(self.config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, DEVICE)
                       for m in (self.torch_model, self.triton_model)}

    def step(self, rows) -> None:
        """rows: (token_ids, start_position, block_table). Compares all tokens' logits."""
        meta = StepMetadata.build([(start, len(toks), table) for toks, start, table in rows],
                                  BLOCK_SIZE, DEVICE, input_ids=[t for toks, _, _ in rows for t in toks])
        out = {}
        for model, caches in self.caches.items():
            attn = model.attention_backend.build_metadata(meta)
            hidden = model(meta.input_ids, meta.positions, caches, attn)
            out[model] = model.compute_logits(hidden)
        expected = out[self.torch_model]
        torch.testing.assert_close(out[self.triton_model], expected, **self.tolerance(expected))

    def tolerance(self, logits):
        return logits_tolerance(logits, self.config.num_hidden_layers, self.config.hidden_size)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, TINY_COMMON["vocab_size"]) for _ in range(n)]


def tables(num_rows: int, blocks_per_row: int, seed: int) -> list[list[int]]:
    ids = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(ids)
    return [ids[r * blocks_per_row:(r + 1) * blocks_per_row] for r in range(num_rows)]


def test_prefill_batch(models):
    pair = Pair(models)
    a, b = tables(2, 3, seed=1)
    pair.step([(tokens(13, 1), 0, a), (tokens(5, 2), 0, b)])


def test_chunked_prefill_after_a_cached_prefix(models):
    pair = Pair(models)
    a, b = tables(2, 4, seed=2)
    prompt = tokens(27, 3)
    pair.step([(prompt[:16], 0, a)])  # a first chunk: two full blocks
    pair.step([(prompt[16:], 16, a)])  # the rest of the prompt after it
    # Another prompt reusing the first two blocks (a prefix-cache hit), computing from 16.
    shared = a[:2] + b[2:]
    pair.step([(tokens(9, 4), 16, shared)])


def test_decode_steps_with_split_k(models, split_k):
    pair = Pair(models)
    a, b = tables(2, 6, seed=3)
    pair.step([(tokens(37, 5), 0, a), (tokens(11, 6), 0, b)])
    lens = [37, 11]
    for step in range(3):
        pair.step([([40 + step], lens[0], a), ([50 + step], lens[1], b)])
        lens = [n + 1 for n in lens]


def test_mixed_batch(models):
    pair = Pair(models)
    a, b, c = tables(3, 4, seed=4)
    long_prompt = tokens(20, 7)
    pair.step([(tokens(9, 8), 0, a), (long_prompt[:12], 0, c)])
    # A decode row, a fresh prefill and the rest of a chunked prompt, in one step.
    pair.step([([77], 9, a), (tokens(6, 9), 0, b), (long_prompt[12:], 12, c)])


def test_graph_metadata_with_padded_rows(models, split_k):
    """A decode step over static buffers of a bigger bucket (what a CUDA graph captures):
    padded rows (slot -1, seq_len 0) store nothing and do not change the real rows."""
    _, triton_model, config = models
    caches = allocate_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, DEVICE)
    a, b = tables(2, 6, seed=5)
    prompts = [tokens(30, 10), tokens(18, 11)]
    backend = triton_model.attention_backend
    for prompt, table in zip(prompts, (a, b)):
        meta = StepMetadata.build([(0, len(prompt), table)], BLOCK_SIZE, DEVICE, input_ids=prompt)
        triton_model(meta.input_ids, meta.positions, caches, backend.build_metadata(meta))
    before = [c.clone() for c in caches]
    rows = [(30, [5], a), (18, [6], b)]
    eager = StepMetadata.build([(s, 1, t) for s, _, t in rows], BLOCK_SIZE, DEVICE, input_ids=[5, 6])
    expected = triton_model(eager.input_ids, eager.positions, caches, backend.build_metadata(eager))
    for cache, saved in zip(caches, before):
        cache.copy_(saved)
    bucket, width = 4, 8
    tables_static = torch.zeros(bucket, width, dtype=torch.int32, device=DEVICE)
    for r, (_, _, table) in enumerate(rows):
        tables_static[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
    slots = [table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE for pos, _, table in rows]
    buffers = DecodeBuffers(
        slot_mapping=torch.tensor(slots + [-1, -1], device=DEVICE),
        seq_lens=torch.tensor([31, 19, 0, 0], dtype=torch.int32, device=DEVICE),
        block_tables=tables_static, max_seq_len=config.max_position_embeddings)
    meta = backend.graph_metadata(buffers)
    assert meta.num_partitions > 1, "the bucket's split-K must be exercised"
    ids = torch.tensor([5, 6, 0, 0], device=DEVICE)
    positions = torch.tensor([30, 18, 0, 0], device=DEVICE)
    hidden = triton_model(ids, positions, caches, meta)
    torch.testing.assert_close(hidden[:2], expected,  # split-K partitions differ: float noise
                               **logits_tolerance(expected, config.num_hidden_layers, config.hidden_size))
    written = [c.ne(s).any(dim=(0, 2, 3, 4)).nonzero().flatten().tolist() for c, s in zip(caches, before)]
    touched = {a[30 // BLOCK_SIZE], b[18 // BLOCK_SIZE]}
    assert all(set(w) <= touched for w in written), "a padded row wrote to the cache"

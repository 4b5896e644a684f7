"""A stand-in for `inflight.runner.worker.Worker`: made-up logits instead of a model, real sampling.

Engine logic (stop words, bad words, min_tokens, penalties, embedding bias, log probs, streaming
deltas, seeds) depends on the logits only through the sampler, so it is tested here in
milliseconds and exactly: a row's logits are a fixed function of its own tokens, so they do not
depend on the batch, the step or the CPU's rounding, and a near tie can never flip a token.
Model parity and batch invariance with real weights stay in test_engine*.py and test_model_parity.py.
"""

from __future__ import annotations

import zlib

import torch

from inflight.api.config import ExecutorConfig
from inflight.model.config import ModelConfig
from inflight.runner.step_inputs import StepOrder
from inflight.sampling.outputs import SamplerOutput
from inflight.sampling.sampler import Sampler, apply_logits_hooks, reduce_prompt_logits

VOCAB = 512
EOS = 2
# Tokens among the last few get this much extra logit: the fake model likes to repeat itself,
# like a real one, so repetition penalties and bad words change what it says.
REPEAT_BONUS = 2.5
REPEAT_WINDOW = 8


def fake_logits(token_ids: list[int], vocab_size: int = VOCAB) -> torch.Tensor:
    """[vocab] float32 logits, a fixed function of `token_ids` (the sequence so far)."""
    seed = zlib.crc32(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes())
    logits = 2.0 * torch.randn(vocab_size, generator=torch.Generator().manual_seed(seed))
    logits[token_ids[-REPEAT_WINDOW:]] += REPEAT_BONUS
    return logits


class FakeWorker:
    """Has what `LLMEngine` uses of a `Worker`; checks each scheduled row's KV block table."""

    def __init__(self, config: ExecutorConfig, max_seq_len: int = 256, check_kv: bool = False):
        """`check_kv`: keep the token each KV slot was written with, and check every row's
        context against its block table (beam forks, copy-on-write, prefix reuse)."""
        self.device = torch.device("cpu")
        self.model_config = ModelConfig.from_hf_dict(
            dict(architectures=["LlamaForCausalLM"], vocab_size=VOCAB, hidden_size=64,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=max_seq_len, eos_token_id=EOS))
        self.max_seq_len = min(config.max_seq_len or max_seq_len, max_seq_len)
        self.block_size = config.kv_cache_config.tokens_per_block
        max_tokens = config.kv_cache_config.max_tokens or config.max_batch_size * self.max_seq_len
        self.num_blocks = -(-max_tokens // self.block_size)
        self.sampler = Sampler()
        self.num_steps = 0
        self.kv_tokens: dict[int, list[int | None]] | None = {} if check_kv else None
        self.num_copied_blocks = 0

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.num_copied_blocks += len(copies)
        if self.kv_tokens is not None:
            for source, destination in copies:
                self.kv_tokens[destination] = list(self.kv_tokens[source])

    def _check_kv(self, item) -> None:
        seq, size = item.seq, self.block_size
        for pos in range(item.start_position, item.context_len):
            slots = self.kv_tokens.setdefault(seq.block_table[pos // size], [None] * size)
            slots[pos % size] = seq.token_ids[pos]
        cached = [self.kv_tokens[seq.block_table[pos // size]][pos % size] for pos in range(item.context_len)]
        assert cached == seq.token_ids[:item.context_len], f"request {seq.request_id}: KV holds other tokens"

    def launch(self, order: StepOrder) -> SamplerOutput:
        """The real worker's one way in; the sample is on the host at once."""
        batch, rows, hooks, request_ids = order.batch, order.rows, order.hooks, order.request_ids
        context_logits, generation_logits = order.context_logits, order.generation_logits
        self.num_steps += 1
        sampled = []
        for item in batch.scheduled:
            table = item.seq.block_table
            assert len(table) * self.block_size >= item.context_len, "KV blocks missing"
            assert len(set(table)) == len(table) and all(0 <= b < self.num_blocks for b in table)
            if self.kv_tokens is not None:
                self._check_kv(item)
            if item.is_sampled:
                sampled.append(fake_logits(item.seq.token_ids[:item.context_len]))
        prompt_logits = None
        if context_logits:
            prompt_logits = torch.stack([
                fake_logits(batch.scheduled[row].seq.token_ids[:batch.scheduled[row].start_position + offset + j + 1])
                for row, offset, count in context_logits for j in range(count)])
        reduced, reduction = None, order.prompt_log_probs
        if reduction is not None:  # the real worker's reduction of the same logits
            reduced = reduce_prompt_logits(prompt_logits, torch.tensor(reduction.targets), reduction.num_top)
            if not reduction.keep_logits:
                prompt_logits = None
        if not sampled:
            return SamplerOutput(token_ids=[], log_probs=[], context_logits=prompt_logits, prompt_log_probs=reduced)
        logits = torch.stack(sampled)  # [num_sampled, vocab]
        kept = logits[generation_logits].clone() if generation_logits else None
        errors = apply_logits_hooks(logits, hooks, request_ids, rows)
        out = self.sampler.sample(logits, rows)
        out.errors = errors
        out.generation_logits, out.context_logits, out.prompt_log_probs = kept, prompt_logits, reduced
        return out

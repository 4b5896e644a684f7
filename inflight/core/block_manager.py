"""Paged KV-cache block allocator with prefix (block) reuse.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence's `block_table` lists
the blocks that hold its positions in order: position p lives in
`block_table[p // block_size]` at offset `p % block_size`.

Prefix reuse: once a block is full and all of its tokens are computed, `commit` registers it
under a chained hash of (parent block's hash, the block's tokens). A later sequence whose leading
full blocks carry the same tokens attaches those blocks instead of recomputing them. Blocks are
ref-counted, so one physical block can sit in several block tables.

Free blocks (ref count 0) are kept in LRU order. A freed block keeps its registered hash and so
stays reusable until it is handed out as a fresh block; only then is its hash dropped. Blocks
without a hash hold nothing worth keeping and are handed out first.
"""

from __future__ import annotations

from collections import OrderedDict

from inflight.core.sequence import Sequence
from inflight.intmath import cdiv

# The identity of a cached block's content: (parent block hash or None for the first block,
# the block's token ids). Compared in full on every hit, so a hash collision never attaches a
# block with different tokens.
_BlockKey = tuple[int | None, tuple[int, ...]]


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block; a module function so tests can force collisions."""
    return hash((parent_hash, token_ids))


def _root(seq: Sequence) -> int | None:
    """The parent of a sequence's first block: none for the base model; per LoRA adapter
    otherwise, since the same tokens have other keys and values under an adapter."""
    return None if seq.lora_id is None else hash(("lora", seq.lora_id))


class BlockManager:
    """Hands out KV blocks to sequences and tracks which ones can be reused.

    Accounting contract: `num_free_blocks` counts blocks that no sequence references, cached or
    not, so after every sequence is freed `num_free_blocks == num_total_blocks`.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.num_total_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.num_reused_blocks = 0
        self.num_allocated_blocks = 0
        self._ref_counts = [0] * num_blocks
        # Insertion order is eviction order: the first key is handed out next.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._block_hash: dict[int, int] = {}
        self._block_key: dict[int, _BlockKey] = {}
        # Chained hashes of each sequence's leading registered (or attached) full blocks, so
        # `commit` only hashes the blocks that became full since the last step.
        self._seq_hashes: dict[Sequence, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_total_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (referenced or not)."""
        return len(self._hash_to_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate_prefix(self, seq: Sequence) -> int:
        """Attach already computed blocks for the leading full blocks of `seq.token_ids`.

        Called once when a sequence with an empty block table is admitted (also after
        preemption). A sequence with a `fork_parent` first shares the parent's computed prompt
        blocks (num_return_sequences > 1: no copy, no hashing); otherwise, with prefix caching,
        cached blocks are found by their hashes. A sequence with `reuse_prefix` false attaches
        nothing. At most `num_tokens - 1` tokens are covered so the model still computes at
        least one token and produces logits. Sets `seq.num_computed_tokens` and
        `seq.num_cached_tokens` to the attached token count and returns it.
        """
        if seq.block_table:
            raise RuntimeError(f"request {seq.request_id}: allocate_prefix needs an empty block table")
        # the last verified token and any draft after it are computed (their logits are read)
        max_num_blocks = max((seq.num_tokens - seq.num_draft_tokens - 1) // self.block_size, 0)
        num_blocks = 0
        if seq.reuse_prefix:
            num_blocks = self._fork(seq, max_num_blocks)
            if num_blocks == 0 and self.enable_prefix_caching:
                num_blocks = self._attach_cached(seq, max_num_blocks)
        seq.num_reused_blocks += num_blocks
        self.num_reused_blocks += num_blocks
        num_cached_tokens = num_blocks * self.block_size
        seq.num_computed_tokens = num_cached_tokens
        seq.num_cached_tokens = num_cached_tokens
        return num_cached_tokens

    def release_prefix(self, seq: Sequence) -> None:
        """Undo `allocate_prefix` for a sequence that could not be admitted after all (the
        blocks stay cached for the next try; nothing is counted as reused)."""
        num_blocks = seq.num_cached_tokens // self.block_size
        seq.num_reused_blocks -= num_blocks
        self.num_reused_blocks -= num_blocks
        self.free(seq)
        seq.num_computed_tokens = 0
        seq.num_cached_tokens = 0

    def _fork(self, seq: Sequence, max_num_blocks: int) -> int:
        """Share the parent's full, computed prompt blocks; returns how many."""
        parent = seq.fork_parent
        if parent is None or parent.is_finished:
            return 0
        num_shared_tokens = min(parent.num_computed_tokens, seq.num_prompt_tokens, parent.num_prompt_tokens)
        num_blocks = min(num_shared_tokens // self.block_size, max_num_blocks, len(parent.block_table))
        if num_blocks == 0 or parent.token_ids[:num_blocks * self.block_size] != \
                seq.token_ids[:num_blocks * self.block_size]:
            return 0
        for block in parent.block_table[:num_blocks]:
            self._ref_counts[block] += 1  # referenced by the parent: never in the free list
            seq.block_table.append(block)
        if self.enable_prefix_caching:
            parent_hashes = self._seq_hashes.get(parent, [])
            self._seq_hashes[seq] = parent_hashes[:num_blocks] if len(parent_hashes) >= num_blocks else []
        return num_blocks

    def _attach_cached(self, seq: Sequence, max_num_blocks: int) -> int:
        """Attach blocks found in the prefix cache by their chained hashes; returns how many."""
        hashes: list[int] = []
        parent = _root(seq)
        for index in range(max_num_blocks):
            tokens = self._block_tokens(seq, index)
            block_hash = hash_block_tokens(parent, tokens)
            block = self._hash_to_block.get(block_hash)
            if block is None or self._block_key[block] != (parent, tokens):
                break
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            seq.block_table.append(block)
            hashes.append(block_hash)
            parent = block_hash
        self._seq_hashes[seq] = hashes
        return len(hashes)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Fresh blocks `seq` still needs so its block table covers positions [0, num_tokens)."""
        return max(self.num_blocks_for(num_tokens) - len(seq.block_table), 0)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow `seq.block_table` to cover positions [0, num_tokens); raise if blocks are short."""
        num_missing = self.num_missing_blocks(seq, num_tokens)
        if num_missing > len(self._free):
            raise RuntimeError(
                f"request {seq.request_id}: needs {num_missing} more KV blocks for {num_tokens} tokens "
                f"but only {len(self._free)} are free")
        for _ in range(num_missing):
            block, _ = self._free.popitem(last=False)
            self._forget_hash(block)
            self._ref_counts[block] = 1
            seq.block_table.append(block)
        self.num_allocated_blocks += num_missing
        seq.num_new_blocks += num_missing

    def commit(self, seq: Sequence) -> None:
        """Register the blocks of `seq` that are now full and fully computed for later reuse.

        A block whose content is already registered under another block id stays unregistered
        (it is a duplicate computed in the same step); it is freed like any other block.
        """
        if not self.enable_prefix_caching or not seq.block_table:
            return
        hashes = self._seq_hashes.setdefault(seq, [])
        # a computed draft is not registered: positions the engine rejects are written again
        num_verified = min(seq.num_computed_tokens, seq.num_tokens - seq.num_draft_tokens)
        num_full_blocks = min(num_verified // self.block_size, len(seq.block_table))
        for index in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else _root(seq)
            tokens = self._block_tokens(seq, index)
            block_hash = hash_block_tokens(parent, tokens)
            hashes.append(block_hash)
            block = seq.block_table[index]
            if block_hash in self._hash_to_block or block in self._block_hash:
                continue
            self._hash_to_block[block_hash] = block
            self._block_hash[block] = block_hash
            self._block_key[block] = (parent, tokens)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's block references and clear its block table; idempotent."""
        # Reverse order: the tail of a prefix is the least likely to be shared, so among the
        # cached blocks it is evicted first.
        for block in reversed(seq.block_table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] < 0:
                raise RuntimeError(f"block {block} freed more often than it was referenced")
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._block_hash:
                    self._free.move_to_end(block, last=False)
        # A new list, not clear(): a holder of the old list (the CUDA-graph runner's staging
        # remembers which table it copied) sees the table was dropped, not rewritten.
        seq.block_table = []
        self._seq_hashes.pop(seq, None)

    def reassign_beams(self, beams: list[Sequence], parents: list[int]) -> list[tuple[int, int]]:
        """Beam i continues beam `parents[i]` (beams past `len(parents)` end): it takes a copy of that beam's block table (ref
        counts up: blocks are shared, not copied) and drops its own. Then copy-on-write: a
        beam whose next position falls in a partly filled block that another beam also holds
        gets a fresh block for it. Returns the (source, destination) block copies the device
        must make before the beams' next step.

        Every beam's `num_computed_tokens` must equal its parent's (the engine sets them).
        """
        tables = [list(beams[p].block_table) for p in parents]
        hashes = [list(self._seq_hashes.get(beams[p], [])) for p in parents]
        for table in tables:
            for block in table:
                self._ref_counts[block] += 1
        for beam, table, chain in zip(beams, tables, hashes):
            self.free(beam)  # gives the beam a new list: the copy-on-write below edits only it
            beam.block_table.extend(table)
            if self.enable_prefix_caching:
                self._seq_hashes[beam] = chain
        for beam in beams[len(parents):]:  # beams with no continuation left
            self.free(beam)
        copies = []
        for beam in beams[:len(parents)]:
            index, offset = divmod(beam.num_computed_tokens, self.block_size)
            if offset == 0 or index >= len(beam.block_table):
                continue  # the next position starts a block of its own
            source = beam.block_table[index]
            if self._ref_counts[source] > 1:
                if not self._free:
                    raise RuntimeError(f"request {beam.request_id}: no free KV block for a beam's "
                                       f"copy-on-write; admission should have reserved it")
                block, _ = self._free.popitem(last=False)
                self._forget_hash(block)
                self._ref_counts[block] = 1
                self._ref_counts[source] -= 1
                beam.block_table[index] = block
                self.num_allocated_blocks += 1
                copies.append((source, block))
        return copies

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def free_block_ids(self) -> list[int]:
        """Free block ids in the order they would be handed out (for tests and debugging)."""
        return list(self._free)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start:start + self.block_size])

    def _forget_hash(self, block: int) -> None:
        block_hash = self._block_hash.pop(block, None)
        if block_hash is not None:
            del self._hash_to_block[block_hash]
            del self._block_key[block]

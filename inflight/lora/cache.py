"""The host cache of LoRA adapters by task id, with TensorRT-LLM's contract.

The first request for a task id carries the adapter's weights (`lora_weights` / `lora_config`);
later ones carry the id alone and get the cached adapter. An id that was never sent, or was
evicted, gets TensorRT-LLM's exact error text (`not_cached_message`). The cache holds at most
`max_bytes` of adapters. A new adapter evicts the least recently used ones that no live request
holds; when every cached adapter is held, the new one is refused, again with TensorRT-LLM's
text. Requests hold their adapter from admission to their end (`hold` / `release`), so an
adapter in use is never evicted.

Thread-safe: requests are resolved on the callers' threads, held and released on the engine's.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

from ensemble.errors import InputError
from inflight.lora.adapter import LoraAdapter


def not_cached_message(task_id: int) -> str:
    """TensorRT-LLM's `PeftTaskNotCachedException` text, word for word."""
    return f"LoRA task {task_id} not found in cache. Please send LoRA weights with request"


CACHE_FULL_MESSAGE = "Cache is full. There are no done tasks to evict"  # TensorRT-LLM's text

_keys = itertools.count(1)


@dataclass(frozen=True)
class CachedLora:
    """An adapter as a request uses it. `key` tells apart two uploads under one task id (a
    device copy of the old weights must not serve the new ones)."""

    task_id: int
    key: int
    adapter: LoraAdapter


class LoraCache:
    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"lora_cache_host_memory_bytes must be > 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[int, CachedLora] = OrderedDict()  # least recently used first
        self._holders: dict[int, int] = {}  # task id -> live requests holding it
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def task_ids(self) -> list[int]:
        with self._lock:
            return list(self._entries)

    def put(self, task_id: int, adapter: LoraAdapter) -> CachedLora:
        """Caches `adapter` under `task_id` (replacing what the id held), evicting as needed.
        Raises InputError if it cannot fit."""
        size = adapter.num_bytes
        if size > self.max_bytes:
            raise InputError(f"LoRA task {task_id}'s weights take {size} bytes, more than the whole "
                             f"LoRA cache ({self.max_bytes} bytes, lora_cache_host_memory_bytes)")
        with self._lock:
            old = self._entries.pop(task_id, None)
            if old is not None:
                self._num_bytes -= old.adapter.num_bytes
            try:
                self._evict_for(size)
            except InputError:
                if old is not None:  # keep what was there
                    self._entries[task_id] = old
                    self._num_bytes += old.adapter.num_bytes
                raise
            entry = CachedLora(task_id, next(_keys), adapter)
            self._entries[task_id] = entry
            self._num_bytes += size
            return entry

    def get(self, task_id: int) -> CachedLora:
        """The cached adapter, now the most recently used. Raises InputError with TensorRT-LLM's
        text if the id is not cached."""
        with self._lock:
            entry = self._entries.get(task_id)
            if entry is None:
                raise InputError(not_cached_message(task_id))
            self._entries.move_to_end(task_id)
            return entry

    def hold(self, lora: CachedLora) -> None:
        """A live request uses `lora`: it is not evicted until released. If it was evicted
        since the request was resolved, it goes back in (the request has its weights)."""
        with self._lock:
            self._holders[lora.task_id] = self._holders.get(lora.task_id, 0) + 1
            if lora.task_id not in self._entries:
                self._entries[lora.task_id] = lora  # may exceed max_bytes until released
                self._num_bytes += lora.adapter.num_bytes

    def release(self, lora: CachedLora) -> None:
        with self._lock:
            count = self._holders.get(lora.task_id, 0) - 1
            if count > 0:
                self._holders[lora.task_id] = count
            else:
                self._holders.pop(lora.task_id, None)

    def _evict_for(self, size: int) -> None:
        """Evicts least recently used adapters that nobody holds until `size` more bytes fit."""
        for task_id in list(self._entries):
            if self._num_bytes + size <= self.max_bytes:
                return
            if self._holders.get(task_id):
                continue
            self._num_bytes -= self._entries.pop(task_id).adapter.num_bytes
        if self._num_bytes + size > self.max_bytes:
            raise InputError(CACHE_FULL_MESSAGE)

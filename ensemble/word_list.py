"""NVIDIA's stop/bad word-list tensor format, shared by the tokenizer and the engine model.

Word-list format (NVIDIA `inflight_batcher_llm`), one `[2, N]` int32 slab per batch row:
row 0 holds the token ids of all words back to back (padded with 0), row 1 the cumulative end
offset of each word in row 0 (padded with -1). Words "ab" → [5, 6] and "c" → [7] give
`[[5, 6, 7], [2, 3]]` padded to `[[5, 6, 7], [2, 3, -1]]`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ensemble.errors import InputError


def parse_word_list(arr: Any) -> list[list[int]]:
    """Inverse of `TextTokenizer.word_list` for one request: `[2, N]` (or `[1, 2, N]`) → words.

    -1 offsets are padding and ignored; the other offsets must be strictly increasing and at
    most N. Raises InputError on anything else, since the tensor comes straight from a client.
    """
    a = np.asarray(arr)
    if a.ndim == 3 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 2 or a.shape[0] != 2:
        raise InputError(f"word list must have shape [2, N], got {list(np.shape(arr))}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InputError(f"word list must be integers, got {a.dtype}")
    ids = a[0].astype(np.int64)
    num_ids = ids.shape[0]
    words: list[list[int]] = []
    start = 0
    for offset in a[1].tolist():
        if offset == -1:
            continue
        if offset < 0:
            raise InputError(f"word list has a negative offset {offset}")
        if offset > num_ids:
            raise InputError(f"word list has offsets past the end ({offset} > {num_ids} ids)")
        if offset <= start:
            raise InputError(f"word list offsets must be strictly increasing (got {offset} after {start})")
        words.append(ids[start:offset].tolist())
        start = offset
    return words

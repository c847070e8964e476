"""Restores read chunks straight into pinned host slots, so every H2D copy is asynchronous.

``RestoreBuffers`` wraps a ``StagingPool`` of ``restore_staging_bytes`` whose slots fit one
encoded chunk (header + payload). ``load`` reads a chunk range through the store's ``get_into``
path into slots (no per-chunk allocation); ``payload`` gives a chunk tensor that views its slot
(pinned on a GPU host). When the pool cannot hold a whole range, ``load`` reads into new pageable
bytes as before, and ``payload`` counts every chunk restored from pageable memory.

Ownership: the slots of a ``LoadedRange`` (its ``buffers``) belong to whoever holds the range.
``release`` gives them back at once (a range no device copy reads: dropped, or host copies done);
``release_after(slots, fence)`` once the fence completed (copies still in flight may read them).
Threads: any. Failure: ``load`` raises only what ``load_range`` raises, its slots given back.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.cache import PrefixCache
from kvtier.chunk import HEADER_SIZE, PAGE
from kvtier.codec import Buf
from kvtier.prefetch import LoadedRange, load_range

from .blocks import payload_tensor
from .partial import load_with_partial
from .staging import Done, StagingPool


class RestoreBuffers:
    def __init__(self, max_bytes: int, chunk_shape: Sequence[int], dtype: torch.dtype,
                 alloc: Callable[[int], torch.Tensor], on_pageable: Callable[[int], None]) -> None:
        """``on_pageable(n)`` counts ``n`` chunks restored from pageable memory."""
        probe = StagingPool(0, chunk_shape, dtype, alloc)
        raw = probe.chunk_bytes
        # Room for an encoded chunk with any codec (lz4 and zstd can grow incompressible data by
        # ~1/255), whole pages so slots stay page-aligned for O_DIRECT reads.
        slot = -(-(HEADER_SIZE + raw + raw // 255 + 64) // PAGE) * PAGE
        self.pool = StagingPool(max_bytes, chunk_shape, dtype, alloc, slot_bytes=slot)
        self._on_pageable = on_pageable

    def load(self, cache: PrefixCache, tokens: np.ndarray, c0: int, c1: int,
             partial_end: int = 0) -> LoadedRange:
        """``load_range`` into slots (``buffers``: the slot list), or into pageable bytes.

        ``partial_end``: load chunks ``c0 ..`` of ``tokens[:partial_end]`` instead, the last one
        the partial chunk ending there (partial.py); ``c1`` is then ignored."""
        pool = self.pool
        c = cache.chunk_tokens
        n = (partial_end // c + 1 - c0) if partial_end else c1 - c0
        slots = pool.take(n)
        if len(slots) < n:
            pool.give(slots)
            if partial_end:
                return load_with_partial(cache, tokens, c0, partial_end)
            return load_range(cache, tokens, c0, c1)
        outs = [pool.raw(i).numpy().data for i in slots]
        try:
            if partial_end:
                return load_with_partial(cache, tokens, c0, partial_end, outs, buffers=slots)
            return load_range(cache, tokens, c0, c1, outs, buffers=slots)
        except BaseException:
            pool.give(slots)  # no copy was started from them
            raise

    def payload(self, res: LoadedRange, j: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Chunk ``j`` of ``res`` as a tensor: a view of its pinned slot where it lies there."""
        data: Buf = res.payloads[j]
        slots = res.buffers if isinstance(res.buffers, list) else None
        if slots is not None and tuple(shape) != self.pool.chunk_shape:
            return payload_tensor(data, shape, dtype)  # a partial chunk, still in its slot
        t = self.pool.view_of(slots[j], data) if slots is not None else None
        if t is None:
            self._on_pageable(1)
            t = payload_tensor(data, shape, dtype)
        return t

    def release(self, res: LoadedRange) -> None:
        if isinstance(res.buffers, list):
            self.pool.give(res.buffers)

    def slots(self, res: LoadedRange) -> list[int]:
        return list(res.buffers) if isinstance(res.buffers, list) else []

    def release_after(self, slots: Sequence[int], fence: Done) -> None:
        self.pool.give_after(slots, fence)

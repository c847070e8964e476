"""A byte-bounded, preallocated pool of host buffers that captured chunks are copied into.

One slot holds one chunk ``(L, P, C, H, D)``; the pool is ``max_bytes // chunk_bytes`` slots
allocated once (pinned on a GPU host, so device-to-host copies are asynchronous), never grown.
Why bounded: a pinned buffer per save job, cached forever, reaches hundreds of GiB under a
queue of long prefills, and an allocation failure inside ``save_kv_layer`` would kill the
engine. When the pool runs short a job keeps the leading chunks it got slots for (a shorter
prefix is still a valid cache entry) and the rest of the save is dropped and counted.

Threads: ``take`` on the forward thread, ``give`` on the saver thread (after the job's fence
and the store's copy): a slot is never handed out twice while its bytes may still be written
or read. Failure: none (an empty pool returns no slots).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch


class StagingPool:
    def __init__(self, max_bytes: int, chunk_shape: Sequence[int], dtype: torch.dtype,
                 alloc: Callable[[int], torch.Tensor]) -> None:
        """``alloc(nbytes)`` returns a uint8 host tensor of ``nbytes`` (pinned where it matters)."""
        numel = 1
        for n in chunk_shape:
            numel *= int(n)
        self.chunk_shape = tuple(int(n) for n in chunk_shape)
        self.chunk_bytes = numel * dtype.itemsize
        self.slots = max_bytes // self.chunk_bytes if self.chunk_bytes else 0
        raw = alloc(self.slots * self.chunk_bytes)
        self._chunks = raw.view(dtype).view(self.slots, *self.chunk_shape) if self.slots else None
        self._free = list(range(self.slots - 1, -1, -1))
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer, possibly none, when the pool is short)."""
        with self._lock:
            k = min(n, len(self._free))
            got = [self._free.pop() for _ in range(k)]
        return got

    def tensor(self, slot: int) -> torch.Tensor:
        assert self._chunks is not None
        return self._chunks[slot]

    def give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    @property
    def free(self) -> int:
        with self._lock:
            return len(self._free)

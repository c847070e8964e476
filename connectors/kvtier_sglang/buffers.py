"""Reusable page-aligned chunk buffers, one set per calling thread.

Why: a fresh ``bytes`` (or buffer) per page costs page faults on every call, which on these
machines is most of a page's read or write time. SGLang calls the backend from a few long-lived
threads (prefetch IO, backup, scheduler), so each thread keeps one batch of chunk-sized,
page-aligned buffers (``kvtier.chunk.page_aligned_buffer``: the disk tier reads/writes them with
O_DIRECT in place) and reuses them for every call; a request larger than one batch is streamed
through them batch by batch. Reads and writes use a ring of sets (readahead.py: the next
batches are read into the others while one set's pages are copied into the pool;
writebehind.py: the earlier batches are stored from the others while one is filled): up to about
``BATCH_BYTES + READ_AHEAD_BYTES`` per calling thread, or 1 + ``MAX_AHEAD`` pages where a page
is larger.

Ownership: a thread's buffers are its own (``threading.local``, so no lock), lent to the
backend's I/O threads only for the length of one of its calls (readahead.py and writebehind.py
wait for them before returning).
"""

from __future__ import annotations

import threading

from kvtier.chunk import HEADER_SIZE, PAGE, page_aligned_buffer

BATCH_BYTES = 8 << 20  # chunk bytes per batch: streams large requests, keeps a thread's set small
# Batches read ahead of the copy or stored behind it: about this many bytes, 1 to MAX_AHEAD batches.
READ_AHEAD_BYTES = 16 << 20
MAX_AHEAD = 3


def chunk_buffer_bytes(page_bytes: int) -> int:
    """Room for one page chunk, encoded with any codec (lz4 and zstd can grow incompressible
    data by ~1/255), rounded to whole pages."""
    return -(-(HEADER_SIZE + page_bytes + page_bytes // 255 + 64) // PAGE) * PAGE


class ThreadBuffers:
    """Per-thread batches of chunk buffers for pages of ``page_bytes`` raw bytes."""

    def __init__(self, page_bytes: int) -> None:
        self.size = chunk_buffer_bytes(page_bytes)
        self.per_batch = max(1, BATCH_BYTES // self.size)
        batch_bytes = self.per_batch * self.size
        self.ring_sets = 1 + max(1, min(MAX_AHEAD, READ_AHEAD_BYTES // batch_bytes))
        self._local = threading.local()

    def batch(self, n: int, which: int = 0) -> list[memoryview]:
        """``min(n, per_batch)`` buffers of ``size`` bytes owned by the calling thread, from
        its set ``which`` (``0 <= which < ring_sets``; sets never share a buffer)."""
        name = f"bufs{which}"
        have: list[memoryview] = getattr(self._local, name, None) or []
        want = min(n, self.per_batch)
        if len(have) < want:
            have = have + [page_aligned_buffer(self.size) for _ in range(want - len(have))]
            setattr(self._local, name, have)
        return have[:want]

    def sets(self, n: int) -> list[list[memoryview]]:
        """The ring the read-ahead and write-behind use: :attr:`ring_sets` disjoint sets of
        ``min(n, per_batch)`` buffers each."""
        return [self.batch(n, which) for which in range(self.ring_sets)]

"""Pages read through the store batch by batch, the next batch's reads in flight while this
batch is copied into the host pool.

Why: a page the store reads into a chunk buffer (the disk tier, Redis; every tier below an
in-process cpu tier) is read, verified there, then copied (strided) into the pool. One after
the other, the device idles while the CPU copies and the CPU idles while the device reads. So
while batch ``k`` is copied, batch ``k + 1`` is already being read into the thread's second
buffer set. Measured 2026-12-06 (2-core AMD EPYC VM, 4 MiB pages, one page per batch,
``bench/e2e_sglang.py --tiers disk,disk-buffered``, medians of 4-5 repeats, before -> after,
same VM): the disk tier's O_DIRECT reads 0.98 -> 1.48, 0.87 -> 1.16 and 1.08 -> 1.10 GB/s (the
device's own speed moves this much between runs); buffered reads from the page cache, where
both steps are CPU copies on two cores, 3.80 / 3.32 / 3.67 -> 3.85 / 3.30 / 3.33 GB/s (no
gain). Larger batches (4 pages, so the disk tier reads four at a time) did worse in one run:
1.28 and 3.00 GB/s (16 MiB per batch no longer stays in the caches between the read, the
check and the copy).

Order and stopping: batches are loaded in key order and the next one is asked for only when the
current one came back whole, so nothing past the first miss or refused chunk is read (and none
of it is copied: ``copy`` sees the leading verified pages only, in order).

Threads: ``copy`` runs on the calling thread; ``load`` runs on ``pool`` (the backend's small
read-ahead pool). Every ``load`` has ended before :func:`read_ahead` returns or raises, so no
read writes into a buffer its owner has taken back. ``load`` may raise: the exception reaches the
caller after the other load in flight has ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait

from kvtier.cache import VerifiedRun
from kvtier.codec import Buf

Load = Callable[[int, Sequence[memoryview]], VerifiedRun]  # (first index, buffers) -> verified run
Copy = Callable[[int, Buf], None]                           # (index, verified payload) -> None


def read_ahead(load: Load, copy: Copy, start: int, end: int, sets: tuple[Sequence[memoryview], Sequence[memoryview]],
               pool: Executor) -> int:
    """Load pages ``start..end`` in batches of ``len(sets[0])`` (``sets``: two equal lists of
    chunk buffers, used in turn) and ``copy`` each verified payload; returns the index after
    the last page copied (``start`` when the first page missed)."""
    size = len(sets[0])
    if size < 1 or len(sets[1]) != size:
        raise ValueError(f"read_ahead needs two buffer sets of one size, got {len(sets[0])} and {len(sets[1])}")

    def submit(first: int, which: int) -> Future[VerifiedRun]:
        return pool.submit(load, first, sets[which][:min(size, end - first)])

    pos, which = start, 0
    pending: Future[VerifiedRun] | None = submit(pos, which) if pos < end else None
    try:
        while pending is not None:
            run = pending.result()
            pending = None
            want = min(size, end - pos)
            hi = pos + want
            whole = len(run.payloads) == want
            if whole and hi < end:
                which ^= 1
                pending = submit(hi, which)
            for j, payload in enumerate(run.payloads):
                copy(pos + j, payload)
            pos += len(run.payloads)
            if not whole:
                break
        return pos
    finally:
        if pending is not None:
            wait([pending])  # it reads into the other set: never hand the buffers back under it


class ReaderThreads:
    """A backend's read-ahead threads, started on first use: one per SGLang thread that reads
    at once (prefetch IO, scheduler), a few at most. After :meth:`close` (which waits for the
    reads in flight, so none outlives the store it reads) :meth:`pool` raises RuntimeError."""

    def __init__(self, threads: int = 4) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def pool(self) -> Executor:
        with self._lock:
            if self._closed:
                raise RuntimeError("kvtier_sglang: the backend is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, "kvtier-sglang-readahead")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)

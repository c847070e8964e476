"""Pages read through the store batch by batch, the next batches' reads in flight while this
batch is copied into the host pool.

Why: a page the store reads into a chunk buffer (the disk tier, Redis; every tier below an
in-process cpu tier) is read, verified there, then copied (strided) into the pool. One after
the other, the device idles while the CPU copies and the CPU idles while the device reads, and
with pages of a few MiB (one page per 8 MiB batch) the disk tier read one file at a time. So
the calling thread's buffers form a ring of sets (buffers.py: about 16 MiB ahead, one to three
batches): while one batch is copied, the next ones are being read into the other sets, each by
its own reader thread, so a device sees several reads queued.

Measured 2026-12-06 (2-core AMD EPYC VM, 4 MiB pages, ``bench/e2e_sglang.py --tiers
disk,disk-buffered --repeats 4``, medians, same-VM pairs run alternately):

- none -> one batch ahead: O_DIRECT disk reads 0.87 -> 1.16 and 1.08 -> 1.10 GB/s (0.98 ->
  1.48 in a first pair); buffered 3.32 -> 3.30 and 3.67 -> 3.33 GB/s;
- one -> three batches ahead (the ring): O_DIRECT 0.97 -> 1.49 and 1.12 -> 1.35 GB/s;
  buffered 3.29 -> 3.72 and 3.38 -> 4.09 GB/s (the raw device: 1.28 / 1.48 / 1.79 GB/s with
  1 / 2 / 4 reads of 4 MiB in flight).

Larger batches instead (four pages each, so the disk tier reads four at a time, one ahead)
did worse: 1.28 and 3.00 GB/s.

Order and stopping: batches are asked for in key order, and none after one that came back
short (a miss or a refused chunk); the few already in flight then are waited for and dropped,
so ``copy`` sees exactly the leading verified pages, in order. A read past a miss costs only
device time: SGLang asks to read pages ``batch_exists`` has just found.

Threads: ``copy`` runs on the calling thread; ``load`` runs on ``pool`` (the backend's
:class:`~kvtier_sglang.iothreads.IOThreads`). Every ``load`` has ended before
:func:`read_ahead` returns or raises, so no read writes into a buffer its owner has taken
back. ``load`` may raise: the exception reaches the caller after the other loads in flight
have ended.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, wait

from kvtier.cache import VerifiedRun
from kvtier.codec import Buf

Load = Callable[[int, Sequence[memoryview]], VerifiedRun]  # (first index, buffers) -> verified run
Copy = Callable[[int, Buf], None]                           # (index, verified payload) -> None


def read_ahead(load: Load, copy: Copy, start: int, end: int, sets: Sequence[Sequence[memoryview]],
               pool: Executor) -> int:
    """Load pages ``start..end`` in batches of ``len(sets[0])`` and ``copy`` each verified
    payload, in order; returns the index after the last page copied (``start`` when the first
    page missed). ``sets``: two or more equal lists of chunk buffers, used in turn: up to
    ``len(sets) - 1`` batches are read ahead while one is copied, and a set is read into again
    only after its batch was copied. Batches already in flight when one comes back short are
    waited for, never copied; no new one is asked for."""
    size = len(sets[0]) if sets else 0
    if len(sets) < 2 or size < 1 or any(len(s) != size for s in sets):
        raise ValueError(f"read_ahead needs two or more buffer sets of one size, got sizes {[len(s) for s in sets]}")
    inflight: deque[tuple[int, int, Future[VerifiedRun]]] = deque()  # (first page, pages, its load)
    nxt, batch = start, 0

    def fill() -> None:
        nonlocal nxt, batch
        while nxt < end and len(inflight) < len(sets) - 1:  # one set is the one being copied
            n = min(size, end - nxt)
            inflight.append((nxt, n, pool.submit(load, nxt, sets[batch % len(sets)][:n])))
            nxt, batch = nxt + n, batch + 1

    pos = start
    try:
        fill()
        while inflight:
            first, n, pending = inflight.popleft()
            run = pending.result()
            whole = len(run.payloads) == n
            if whole:
                fill()
            for j, payload in enumerate(run.payloads):
                copy(first + j, payload)
            pos = first + len(run.payloads)
            if not whole:
                break
        return pos
    finally:
        # Loads still in flight read into our sets: never hand the buffers back under them.
        wait([f for _, _, f in inflight])

"""Pages written through the store batch by batch, the stores of earlier batches in flight while
the next batch is copied out of the host pool.

Why: a page bound for a tier the store writes from a chunk buffer (the disk tier, Redis) is
copied (strided) out of the pool into the buffer and framed there, then the store writes it.
One after the other, the CPU copying and the kernel writing (page-cache allocation, or the
device under O_DIRECT) never overlap. So the calling thread fills the batches into a ring of
buffer sets (buffers.py) and each filled batch is stored on an I/O thread while the next is
filled. Measured 2026-12-06 (2-core AMD EPYC VM, 4 MiB pages, ``bench/e2e_sglang.py --tiers
disk,disk-buffered --repeats 4``, medians, same-VM pairs before -> after, run alternately):
O_DIRECT disk writes 0.70 -> 0.93, 0.83 -> 0.95, and with the page cache dropped before each
run 0.65 -> 1.01 and 0.72 -> 0.92 GB/s; buffered 2.24 -> 1.16, 1.61 -> 3.00, 2.28 -> 2.93 and
2.11 -> 2.41 GB/s (page-cache writeback makes these swing). Keeping one store in flight (stores
in order) gained less in a trial: buffered 2.57 and 2.16 GB/s.

Order: stores of different batches may run at once and end in any order. The tiers and the
eviction policies take that: each put is atomic under its tier's lock, and the prefix-aware
policies count a child whose parent has not arrived yet (``kvtier.policies.tree``).

Threads and ownership: ``fill`` runs on the calling thread, ``store`` on ``pool``. A set is
filled again only after the store of the batch it last held has ended, and every store has
ended before :func:`write_behind` returns or raises (a store reads the caller's buffers). An
exception from ``fill`` or ``store`` reaches the caller after the other stores in flight end.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future, wait

from kvtier.tiers.base import Entry

Fill = Callable[[int, int, int], list[Entry]]  # (first page, pages, set) -> the batch's entries
Store = Callable[[list[Entry]], int]           # entries -> how many the store accepted


def write_behind(fill: Fill, store: Store, count: int, per_batch: int, sets: int, pool: Executor) -> int:
    """Store pages ``0..count`` in batches of ``per_batch``: ``fill(first, n, s)`` builds a
    batch's entries in buffer set ``s`` (``0 <= s < sets``; no store of set ``s`` is in flight
    then), ``store`` writes them on ``pool``. Returns the pages accepted, summed."""
    if sets < 1 or per_batch < 1:
        raise ValueError(f"write_behind needs at least one buffer set and one page per batch, "
                         f"got {sets} and {per_batch}")
    inflight: deque[Future[int]] = deque()  # the batches of the last ``sets`` fills, oldest first
    accepted = 0
    try:
        for b, first in enumerate(range(0, count, per_batch)):
            if len(inflight) == sets:  # set b % sets holds batch b - sets: wait for its store
                accepted += inflight.popleft().result()
            inflight.append(pool.submit(store, fill(first, min(per_batch, count - first), b % sets)))
        while inflight:
            accepted += inflight.popleft().result()
        return accepted
    finally:
        wait(inflight)  # stores still in flight read our buffers: never hand them back under them

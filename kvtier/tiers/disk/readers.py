"""Reads of one batch several at a time, on one small thread pool shared by every disk tier.

Why: an SSD serves several reads in flight faster than one (measured here, 1 MiB O_DIRECT
reads: 1.7-1.8 GB/s one at a time, 2.2-2.8 GB/s four at a time), and a reader of several
chunks (the store's ``load_into``, SGLang's ``batch_get_v1``, the vLLM and transformers
restores) asks for a batch. The GIL is released while a thread waits on its ``preadv``.

Why one pool for the process, not one per tier: a kvtier-server holds a disk tier per tenant,
and idle per-tier pools would add threads with every tenant. The pool has :data:`POOL_THREADS`
threads, made on first use; a batch keeps at most ``depth`` of them busy, so one caller cannot
take every thread, and callers beyond the pool's size wait their turn. A child process made
by ``fork`` inherits the pool's state but none of its threads: it starts a pool of its own.

Threads: any thread may call :func:`read_all`; it blocks until the batch's reads have ended.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar, cast

T = TypeVar("T")
R = TypeVar("R")

POOL_THREADS = 16  # upper bound of DiskTierConfig.read_threads

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _reset_after_fork() -> None:
    global _lock, _pool
    _lock, _pool = threading.Lock(), None  # the parent's threads (and a held lock) are not here


os.register_at_fork(after_in_child=_reset_after_fork)


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="kvtier-disk-read")
        return _pool


def read_all(read: Callable[[T], R], items: Sequence[T], depth: int) -> list[R]:
    """``[read(item) for item in items]``, with up to ``depth`` reads in flight: the items are
    dealt round-robin to ``depth`` tasks (so the leading items, the ones a prefix needs first,
    are read first). Every read runs even when another raises; the first exception in item
    order is raised once all have ended, so no read still writes into a caller's buffer."""
    depth = min(depth, len(items), POOL_THREADS)
    if depth < 2:
        return [read(item) for item in items]

    def task(first: int) -> list[tuple[R | None, Exception | None]]:
        done: list[tuple[R | None, Exception | None]] = []
        for i in range(first, len(items), depth):
            try:
                done.append((read(items[i]), None))
            except Exception as exc:  # re-raised below, after every read has ended
                done.append((None, exc))
        return done

    pool = _shared_pool()
    tasks: list[Future[list[tuple[R | None, Exception | None]]]] = [pool.submit(task, j) for j in range(depth)]
    wait(tasks)
    slots: list[tuple[R | None, Exception | None]] = [(None, None)] * len(items)
    for j, t in enumerate(tasks):
        slots[j::depth] = t.result()
    out: list[R] = []
    for value, exc in slots:
        if exc is not None:
            raise exc
        out.append(cast(R, value))
    return out

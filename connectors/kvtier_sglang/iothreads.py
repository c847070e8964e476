"""A backend's I/O threads: the reads of the batches read ahead (readahead.py) and the stores of
the batches written behind (writebehind.py) run on them while SGLang's calling thread copies
pages between the host pool and chunk buffers.

Threads: started on first use; a few, since each SGLang thread that calls the backend at once
(prefetch IO, backup, scheduler) keeps up to a ring's worth of batches on them, and callers
beyond that queue behind each other (never deadlock: a queued batch waits for nothing but a
thread). After :meth:`IOThreads.close` (which waits for the batches in flight, so none outlives
the store it reads or writes) :meth:`IOThreads.pool` raises RuntimeError.
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, ThreadPoolExecutor

THREADS = 4


class IOThreads:
    def __init__(self, threads: int = THREADS) -> None:
        self._threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._lock = threading.Lock()

    def pool(self) -> Executor:
        with self._lock:
            if self._closed:
                raise RuntimeError("kvtier_sglang: the backend is closed")
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._threads, "kvtier-sglang-io")
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
        if pool is not None:
            pool.shutdown(wait=True)

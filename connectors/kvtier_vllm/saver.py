"""The saver thread: encode captured chunks and hand them to the store, off the forward pass.

Jobs come from ``wait_for_save`` (one per request with new full chunks this step) with the
chunks already copied out of vLLM's blocks into a staging tensor ``[chunks, L, 2, C, H, D]``,
and a fence the thread waits on first (a CUDA event on GPU hosts). ``PrefixCache.save`` skips
chunks the store already holds, writes the rest through to tier 0 and lets the store cascade
them down asynchronously. A full queue drops the job (counted): a dropped save is only a future
miss, never a stall of the engine.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from kvtier.cache import PrefixCache

from .copier import Fence
from .protocol import SaveSpec, StoredChunks
from .stats import ConnectorMetrics, StatsCollector

log = logging.getLogger(__name__)


class SaveJob:
    def __init__(self, spec: SaveSpec, staging: torch.Tensor, layers: int) -> None:
        self.spec = spec
        self.staging = staging           # [chunks, L, 2, C, H, D]
        self.captured = [False] * layers
        self.fence: Fence | None = None


class Saver:
    def __init__(self, cache_for: Callable[[bytes], PrefixCache], chunk: int, depth: int,
                 thread_init: Callable[[], None], stats: StatsCollector, cmetrics: ConnectorMetrics,
                 on_stored: Callable[[StoredChunks], None] | None = None) -> None:
        self._cache_for = cache_for
        self._chunk = chunk
        self._stats, self._cmetrics = stats, cmetrics
        self._on_stored = on_stored
        self._queue: queue.Queue[SaveJob | None] = queue.Queue(depth)
        self._thread = threading.Thread(target=self._loop, args=(thread_init,), name="kvtier-saver",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> bool:
        """Queue ``job`` (never blocks); False when the queue is full and the job was dropped."""
        try:
            self._queue.put_nowait(job)
            return True
        except queue.Full:
            self._stats.add(save_dropped=1)
            self._cmetrics.save_dropped.inc()
            return False

    def close(self, timeout_s: float = 30) -> None:
        """Finish the queued jobs (bounded by ``timeout_s``), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self, thread_init: Callable[[], None]) -> None:
        thread_init()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._save(job)
            except (RuntimeError, ValueError, OSError) as exc:
                log.error("kvtier: saving %s failed: %s", job.spec.req_id, exc)
                self._stats.add_by("failures_by_reason", "save_error")

    def _save(self, job: SaveJob) -> None:
        assert job.fence is not None
        job.fence.wait()
        spec, c = job.spec, self._chunk
        t0 = time.perf_counter()
        tokens = np.frombuffer(spec.tokens, dtype="<u4")
        raw = job.staging.view(torch.uint8).numpy()

        def payload_for(start: int, end: int) -> memoryview:
            return memoryview(raw[start // c - spec.start_chunk])

        cache = self._cache_for(spec.salt)
        n = cache.save(tokens, payload_for, start_chunk=spec.start_chunk, full_chunks_only=True)
        self._stats.add(save_chunks=n, save_bytes=n * int(raw[0].nbytes),
                        save_seconds=time.perf_counter() - t0)
        self._cmetrics.save_chunks.inc(n)
        if self._on_stored is not None:
            keys = cache.keys(tokens, full_chunks_only=True)
            parent = keys[spec.start_chunk - 1] if spec.start_chunk else b""
            self._on_stored(StoredChunks(spec.req_id, spec.start_chunk,
                                         keys[spec.start_chunk:spec.end_chunk], "", spec.tokens, parent))

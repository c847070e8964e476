"""The saver thread: encode captured chunks and hand them to the store, off the forward pass.

Jobs come from ``wait_for_save`` (one per request with new full chunks this step) with the
chunks being copied out of vLLM's blocks into staging slots (one ``(L, P, C, H, D)`` tensor per
chunk, from the bounded ``StagingPool``), and a fence the thread waits on first (a CUDA event
on GPU hosts). ``PrefixCache.save`` skips chunks the store already holds, writes the rest
through to tier 0 and lets the store cascade them down asynchronously. Beyond ``depth`` waiting
jobs a job is dropped (counted): a dropped save is only a future miss, never a stall of the
engine. A dropped job still passes through the thread, which waits for its fence before it
returns the slots (copies may still be writing them); the pool bounds how many can wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvtier.cache import PrefixCache

from .copier import CaptureIndex, Fence
from .protocol import SaveSpec
from .stats import ConnectorMetrics, StatsCollector
from .threads import log_failure

log = logging.getLogger(__name__)


class SaveJob:
    """Chunks ``chunks`` (ascending indexes into the prefix ``spec.tokens``, a subset of
    ``[spec.start_chunk, spec.end_chunk)``: the ones this job claimed) captured into ``staging``
    (one ``(L, P, C, H, D)`` tensor per chunk, in the same order); ``keys`` are the keys of every
    full chunk of ``spec.tokens``. ``release`` gives the staging slots back (after the fence
    only); ``unclaim`` releases the claimed keys (after the write, or when dropped).
    ``framed``: per staging tensor, its slot's buffer with ``HEADER_SIZE`` free bytes in front
    of the tensor's bytes (``StagingPool.framed``), so the store may take the slot as the
    chunk itself (``PrefixCache.store_chunks(framed=True)``); None: encode from ``staging``."""

    def __init__(self, spec: SaveSpec, staging: list[torch.Tensor], layers: int,
                 release: Callable[[], None], index: CaptureIndex, chunks: Sequence[int] | None = None,
                 keys: Sequence[bytes] = (), unclaim: Callable[[], None] | None = None,
                 framed: Sequence[memoryview] | None = None) -> None:
        self.spec = spec
        self.staging = staging
        self.chunks = list(range(spec.start_chunk, spec.start_chunk + len(staging))) if chunks is None else list(chunks)
        self.keys = keys
        self.captured = [False] * layers
        self.fence: Fence | None = None
        self.release = release
        self.unclaim = unclaim or (lambda: None)
        self.index = index
        self.framed = framed
        self.dropped = False


class Saver:
    def __init__(self, cache_for: Callable[[bytes], PrefixCache], chunk: int, depth: int,
                 thread_init: Callable[[], None], stats: StatsCollector, cmetrics: ConnectorMetrics,
                 probed: Callable[[], bool] = lambda: False) -> None:
        """``probed()``: whether the capture asks every tier of the store whether it holds a
        chunk before claiming it (capture.py): then a job's chunks are missing and are written
        without a store lookup. False (e.g. a remote tier, not probed from the forward thread):
        look up first and skip the chunks the store holds."""
        self._cache_for = cache_for
        self._probed = probed
        self._chunk = chunk
        self._stats, self._cmetrics = stats, cmetrics
        self._depth = depth
        self._queue: queue.Queue[SaveJob | Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, args=(thread_init,), name="kvtier-saver",
                                        daemon=True)
        self._thread.start()

    def submit(self, job: SaveJob) -> bool:
        """Queue ``job`` (never blocks); False when ``depth`` jobs wait and it was dropped (it
        is still queued, marked dropped, so its slots come back after its fence)."""
        if job.dropped or self._queue.qsize() >= self._depth:
            if not job.dropped:
                self.count_dropped()
            job.dropped = True
        self._queue.put_nowait(job)
        return not job.dropped

    def after_queued(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the saver thread once every job queued before it was written (or
        dropped): what must follow those writes (a purge of their keys) cannot overtake them."""
        self._queue.put_nowait(fn)

    def count_dropped(self, n: int = 1) -> None:
        self._stats.add(save_dropped=n)
        self._cmetrics.save_dropped.inc(n)

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
            if not isinstance(job, SaveJob):
                try:
                    job()
                except Exception as exc:  # as for a job: the thread must outlive it
                    log_failure(log, "a task after the queued saves", exc)
                continue
            try:
                assert job.fence is not None
                job.fence.wait()
                if not job.dropped:
                    self._save(job)
            except Exception as exc:  # the saver must outlive any: later saves would wait forever
                log_failure(log, f"saving {job.spec.req_id}", exc)
                self._stats.add_by("failures_by_reason", "save_error")
            finally:
                job.release()
                job.unclaim()  # written to tier 0 (or dropped): no longer in flight

    def _save(self, job: SaveJob) -> None:
        spec, c = job.spec, self._chunk
        t0 = time.perf_counter()
        tokens = np.frombuffer(spec.tokens, dtype="<u4")
        raw = [t.reshape(-1).view(torch.uint8).numpy() for t in job.staging]
        slot_of = {j: i for i, j in enumerate(job.chunks)}

        def payload_for(start: int, end: int) -> memoryview:
            return raw[slot_of[start // c]].data

        cache = self._cache_for(spec.salt)
        if spec.partial:  # one partial chunk (partial.py): KV events never announce it
            n = cache.save(tokens, payload_for, start_chunk=spec.start_chunk, full_chunks_only=False)
            self._stats.add(partial_save_chunks=n)
        elif job.framed is not None:  # the slots become the chunks (header written in place)
            framed = job.framed
            n = cache.store_chunks(job.keys, job.chunks, lambda j: framed[slot_of[j]],
                                   skip_held=not self._probed(), framed=True)
        else:  # job.keys: the capture's keys of the prefix; no rehash here
            n = cache.store_chunks(job.keys, job.chunks, lambda j: raw[slot_of[j]].data,
                                   skip_held=not self._probed())
        self._stats.add(save_chunks=n, save_bytes=n * int(raw[0].nbytes) if raw else 0,
                        save_seconds=time.perf_counter() - t0)
        self._cmetrics.save_chunks.inc(n)


"""The forward-thread half of saves: capture each layer's new full chunks into staging slots.

``save_kv_layer`` -> ``layer``: on the first call of a step, one ``SaveJob`` per request the
scheduler named, holding only the chunks nobody else is saving: a chunk the local tiers already
hold, or whose key another job (of this step or an earlier one) claimed in the shared
``InflightChunks`` and has not written yet, is neither copied nor written again (counted as
``save_deduped_chunks``). Each kept chunk gets a slot from the bounded ``StagingPool`` (a
short pool keeps the leading chunks and counts the rest as dropped); then the copier captures
that layer of every job. ``wait_for_save`` -> ``end``: capture layers no ``save_kv_layer``
call covered, end the capture (one fence for the step) and hand the jobs to the saver thread,
which releases their keys once written (or dropped).

Failure: nothing raises into the engine. A capture error (a device out of memory, a bad shape)
drops the step's saves, counted as ``failures_by_reason["save_error"]``; the jobs still go to
the saver marked dropped, which returns their slots after the fence (copies may still be
writing them) and releases their keys. Threads: forward thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.cache import PrefixCache

from .blocks import Views
from .copier import Copier
from .inflight import InflightChunks
from .protocol import SaveSpec
from .saver import SaveJob, Saver
from .staging import StagingPool
from .stats import StatsCollector

log = logging.getLogger(__name__)


class StepCapture:
    def __init__(self, copier: Copier, pool: StagingPool, saver: Saver, views: Sequence[Views],
                 chunk: int, block_size: int, stats: StatsCollector,
                 cache_for: Callable[[bytes], PrefixCache], inflight: InflightChunks,
                 stored: Callable[[Sequence[bytes]], int]) -> None:
        """``stored(keys)``: how many leading ``keys`` the store already holds, asked of
        tiers cheap to probe from the forward thread (0 when there are none)."""
        self.copier, self.pool, self.saver, self.views = copier, pool, saver, views
        self.chunk, self.per = chunk, chunk // block_size
        self.stats = stats
        self.cache_for, self.inflight, self.stored = cache_for, inflight, stored
        self._jobs: list[SaveJob] = []
        self._failed = False

    def layer(self, saves: Sequence[SaveSpec], layer: int) -> None:
        if not saves or self._failed:
            return
        try:
            if not self._jobs:
                self._jobs = self._new_jobs(saves)
            self._capture(self._jobs, layer)
        except (RuntimeError, ValueError) as exc:  # e.g. torch.cuda.OutOfMemoryError
            self._error(exc)

    def end(self, saves: Sequence[SaveSpec], short: set[str]) -> None:
        """End the step's capture. When ``short`` names any request (its sync load failed),
        every job of the step is dropped, not only that request's: vLLM puts a request's
        blocks in its prefix cache when they are allocated, so another request of the same
        step may have hit the unrestored blocks and computed its KV over them."""
        jobs, self._jobs = self._jobs, []
        failed, self._failed = self._failed, False
        try:
            if not failed and saves and not jobs:
                jobs = self._new_jobs(saves)  # no save_kv_layer calls this step
            if not failed:
                for layer in range(len(self.views)):
                    self._capture([j for j in jobs if not j.captured[layer]], layer)
        except (RuntimeError, ValueError) as exc:
            self._error(exc)
            failed, self._failed = True, False
        try:
            fence = self.copier.end_capture()
        except (RuntimeError, ValueError) as exc:
            # The device is in trouble; the slots of these jobs may still be written: keep them.
            log.error("kvtier: ending the capture failed; %d save(s) and their staging are "
                      "dropped: %s", len(jobs), exc)
            self.saver.count_dropped(len(jobs))
            for job in jobs:
                job.unclaim()  # nothing of them will be written: others may save those chunks
            return
        for job in jobs:
            job.fence = fence
            if failed or short:
                job.dropped = True
            self.saver.submit(job)

    def _error(self, exc: BaseException) -> None:
        log.error("kvtier: capture failed, this step's saves are dropped: %s", exc)
        self.stats.add_by("failures_by_reason", "save_error")
        self._failed = True

    def _new_jobs(self, saves: Sequence[SaveSpec]) -> list[SaveJob]:
        return [job for s in saves if (job := self._new_job(s)) is not None]

    def _new_job(self, spec: SaveSpec) -> SaveJob | None:
        """A job for the chunks of ``spec`` nobody else stores or is storing, with staging
        slots for the leading ones the pool can hold (None: nothing to capture). A partial
        chunk (partial.py) is one job of its own, not deduplicated (saved once per request)."""
        if spec.partial:
            return self._partial_job(spec)
        cache = self.cache_for(spec.salt)
        keys = cache.keys(np.frombuffer(spec.tokens, dtype="<u4"), full_chunks_only=True)
        offered = keys[spec.start_chunk:spec.end_chunk]
        held = self.stored(offered)
        mine = self.inflight.claim(offered[held:])
        chunks = [spec.start_chunk + held + i for i, ok in enumerate(mine) if ok]
        if len(chunks) < len(offered):
            self.stats.add(save_deduped_chunks=len(offered) - len(chunks))
        if not chunks:
            return None
        pool = self.pool
        slots = pool.take(len(chunks))
        if len(slots) < len(chunks):
            self.saver.count_dropped()  # the chunks past the slots are not saved this time
            self.inflight.release(keys[j] for j in chunks[len(slots):])
            chunks = chunks[:len(slots)]
            if not chunks:
                return None
        claimed = [keys[j] for j in chunks]
        per, first = self.per, spec.start_chunk
        ids = [b for j in chunks for b in spec.block_ids[(j - first) * per:(j - first + 1) * per]]
        try:
            index = self.copier.begin_capture(ids, per)
        except (RuntimeError, ValueError):
            pool.give(slots)
            self.inflight.release(claimed)
            raise
        return SaveJob(spec, [pool.tensor(i) for i in slots], len(self.views),
                       lambda: pool.give(slots), index, chunks, keys,
                       lambda: self.inflight.release(claimed),
                       framed=[pool.framed(i) for i in slots] if pool.head else None)

    def _partial_job(self, spec: SaveSpec) -> SaveJob | None:
        """One partial chunk (partial.py) in one slot, viewed as ``(L, P, tokens, H, D)``."""
        pool = self.pool
        slots = pool.take(1)
        if not slots:
            self.saver.count_dropped()
            return None
        shape = list(pool.chunk_shape)
        shape[2] = len(spec.block_ids) * (self.chunk // self.per)
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        staging = pool.payload(slots[0]).view(pool.dtype)[:numel].view(*shape)
        try:
            index = self.copier.begin_capture(spec.block_ids, len(spec.block_ids))
        except (RuntimeError, ValueError):
            pool.give(slots)
            raise
        return SaveJob(spec, [staging], len(self.views), lambda: pool.give(slots), index)

    def _capture(self, jobs: Sequence[SaveJob], layer: int) -> None:
        if jobs:
            self.copier.capture_layer(self.views[layer], layer,
                                      [(job.index, [t[layer] for t in job.staging]) for job in jobs])
        for job in jobs:
            job.captured[layer] = True

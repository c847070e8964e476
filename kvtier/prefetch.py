"""Asynchronous restore: start loading a prefix at lookup time, overlap it with queueing and,
layer by layer, with the forward pass. Engine-agnostic: no engine, no torch.

Three pieces, used by the engine connectors:

``load_range``    load and verify chunks ``[start_chunk, end_chunk)`` of a prefix (a local hit
                  in the engine may already cover the first chunks, so they are not fetched).
``Prefetcher``    runs ``load_range`` jobs on a small thread pool, keyed by a job id (the
                  engine's request id), and keeps the verified payloads in host memory until
                  the engine takes them; bounded by a byte budget.
``LayerPipeline`` one long-lived thread that runs ``step(layer)`` for every layer in order and
                  lets the forward pass wait for *one* layer (``LayerRun.wait(i)``).

Threads: every public method may be called from any thread. Failure: nothing here raises a
store failure to the caller; a failed load is a shorter ``LoadedRange`` with a ``reason``, and a
failed step marks its ``LayerRun`` failed (waiters are released, never left hanging).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.codec import Buf
from kvtier.tiers.base import ABSENT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedRange:
    """Verified payloads of chunks ``start_chunk .. start_chunk + len(payloads) - 1``.

    ``wanted`` is how many chunks were asked for; fewer payloads means the run stopped early
    and ``reason`` says why (a miss-reason label: absent, evicted, corrupt, timeout, ...).
    """

    start_chunk: int
    wanted: int
    payloads: list[Buf] = field(default_factory=list)
    per_tier: dict[str, int] = field(default_factory=dict)
    reason: str = ABSENT
    nbytes: int = 0
    seconds: float = 0.0
    # Opaque handle of caller-owned buffers the payloads view (``load_range(outs=...)``): whoever
    # supplied them releases them; ``Prefetcher(on_drop=...)`` does so for a range never taken.
    buffers: object = None

    @property
    def complete(self) -> bool:
        return len(self.payloads) == self.wanted


def load_range(cache: PrefixCache, tokens: Sequence[int] | np.ndarray, start_chunk: int,
               end_chunk: int, outs: Sequence[memoryview] | None = None,
               buffers: object = None) -> LoadedRange:
    """Load full chunks ``[start_chunk, end_chunk)`` of ``tokens``' prefix and verify each one.

    With ``outs`` (one caller-owned buffer per chunk, see ``PrefixCache.load_verified_into``)
    the chunks are read into them, and the payloads are views of them (or new bytes where a
    codec decompressed them); ``buffers`` is passed through as ``LoadedRange.buffers``.
    A chunk that fails verification is deleted from every tier (so it is recomputed and saved
    again) and ends the run. Never raises for store trouble.
    """
    t0 = time.perf_counter()
    c = cache.chunk_tokens
    if end_chunk * c > len(tokens):
        raise ValueError(f"{len(tokens)} tokens do not cover {end_chunk} full chunks of {c}")
    wanted = max(0, end_chunk - start_chunk)
    if outs is not None and len(outs) != wanted:
        raise ValueError(f"load_range got {len(outs)} buffers for {wanted} chunks")
    if wanted == 0:
        return LoadedRange(start_chunk, 0, buffers=buffers)
    prefix = cache.keys(tokens[: end_chunk * c], full_chunks_only=True)
    spans = [(i * c, (i + 1) * c) for i in range(start_chunk, end_chunk)]
    return read_verified(cache, prefix, start_chunk, spans, outs, buffers, t0)


def read_verified(cache: PrefixCache, prefix: Sequence[bytes], start_chunk: int,
                  spans: Sequence[tuple[int, int]], outs: Sequence[memoryview] | None,
                  buffers: object, t0: float) -> LoadedRange:
    """The verified read of chunks ``prefix[start_chunk:]`` (token ``spans``, one per chunk),
    into ``outs`` when given, as a ``LoadedRange`` timed from ``t0``: the one read path of
    :func:`load_range` and the connectors' variants of it (a trailing partial chunk)."""
    keys = prefix[start_chunk:start_chunk + len(spans)]
    if outs is None:
        run = cache.load_verified(keys, spans, first_index=start_chunk, prefix=prefix)
    else:
        run = cache.load_verified_into(keys, spans, outs, first_index=start_chunk, prefix=prefix)
    return LoadedRange(start_chunk, len(keys), run.payloads, run.per_tier, run.reason, run.nbytes,
                       time.perf_counter() - t0, buffers)


class PrefetchJob:
    """One background load. ``result()`` blocks until it is done (or ``timeout`` passes)."""

    def __init__(self, job_id: str, signature: tuple[object, ...], future: Future[LoadedRange]) -> None:
        self.job_id = job_id
        self.signature = signature
        self.future = future
        self.started = time.perf_counter()

    def done(self) -> bool:
        return self.future.done()

    def result(self, timeout: float | None = None) -> LoadedRange | None:
        """The loaded range, or None when ``timeout`` passed first."""
        try:
            return self.future.result(timeout)
        except TimeoutError:
            return None


class Prefetcher:
    """Background loads keyed by job id, held in host memory until taken.

    ``max_bytes`` bounds the payload bytes held by finished, untaken jobs: the oldest are
    dropped first (a dropped job is simply loaded again when the engine needs it).
    ``on_drop(range)`` runs (once the job finished, on whichever thread finishes it) for every
    job dropped without being taken (trimmed, discarded, replaced, closed): it releases the
    range's ``buffers``. A job taken with ``pop`` is the taker's to release.
    """

    def __init__(self, workers: int = 2, max_bytes: int = 1 << 30, name: str = "kvtier-prefetch",
                 thread_init: Callable[[], None] | None = None,
                 on_drop: Callable[[LoadedRange], None] | None = None) -> None:
        # thread_init runs first in every pool thread (e.g. to move it off the engine's cores).
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix=name,
                                        initializer=thread_init)
        self._jobs: OrderedDict[str, PrefetchJob] = OrderedDict()
        self._lock = threading.Lock()
        self.max_bytes = max_bytes
        self._closed = False
        self._on_drop = on_drop

    def drop(self, job: PrefetchJob) -> None:
        """Release ``job``'s range through ``on_drop`` once it finished (a job no one takes)."""
        on_drop = self._on_drop
        if on_drop is None:
            return

        def release(f: Future[LoadedRange]) -> None:
            if not f.cancelled():
                on_drop(f.result())

        job.future.add_done_callback(release)

    def submit(self, job_id: str, signature: tuple[object, ...],
               fn: Callable[[], LoadedRange]) -> PrefetchJob | None:
        """Start ``fn`` unless a job with this id and signature exists (then return that one).

        A job with the same id and another signature is replaced. None after ``close``.
        """
        with self._lock:
            if self._closed:
                return None
            job = self._jobs.get(job_id)
            if job is not None and job.signature == signature:
                return job
            if job is not None:
                self.drop(job)
            future = self._pool.submit(_guarded, fn)
            job = PrefetchJob(job_id, signature, future)
            self._jobs[job_id] = job
            self._jobs.move_to_end(job_id)
        future.add_done_callback(lambda _f: self._trim())
        return job

    def get(self, job_id: str) -> PrefetchJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def pop(self, job_id: str) -> PrefetchJob | None:
        with self._lock:
            return self._jobs.pop(job_id, None)

    def discard(self, job_ids: Sequence[str]) -> None:
        with self._lock:
            for job_id in job_ids:
                job = self._jobs.pop(job_id, None)
                if job is not None:
                    self.drop(job)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(_held(j) for j in self._jobs.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)

    def _trim(self) -> None:
        with self._lock:
            total = sum(_held(j) for j in self._jobs.values())
            for job_id in list(self._jobs):
                if total <= self.max_bytes:
                    break
                job = self._jobs[job_id]
                if job.done():
                    total -= _held(job)
                    del self._jobs[job_id]
                    self.drop(job)
                    log.debug("prefetch %s dropped: over the %d-byte budget", job_id, self.max_bytes)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
        for job in jobs:
            self.drop(job)
        self._pool.shutdown(wait=True, cancel_futures=True)


def _held(job: PrefetchJob) -> int:
    if not job.done():
        return 0
    res = job.result(0)
    return res.nbytes if res is not None else 0


def _guarded(fn: Callable[[], LoadedRange]) -> LoadedRange:
    # A bug in fn must not leave a waiter hanging, nor break the byte budget's trimming (which
    # reads every finished job's result): any exception becomes an empty range with a reason,
    # logged with its traceback. (It once caught three types; a KeyError escaped to every
    # later held_bytes() and trim.)
    try:
        return fn()
    except Exception:
        log.exception("prefetch job failed")
        return LoadedRange(0, 1, reason="error")


class Cancelled(Exception):
    """Raised inside a :class:`LayerRun` that its owner gave up on (:meth:`LayerRun.cancel`)."""


class LayerRun:
    """Progress of one ``LayerPipeline`` run: ``wait(i)`` returns once layer ``i`` is done.

    Cancellation (a forward pass that will not wait any longer): after :meth:`cancel` returns,
    no step of the run is running or will start, and whatever ``before`` still does must go
    through :meth:`guard` to touch shared state, so a load stuck in the store can never write
    into the engine's memory once its owner moved on."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self._events = [threading.Event() for _ in range(layers)]
        self._finished = threading.Event()
        self._guard = threading.Lock()
        self.cancelled = False
        self.error: BaseException | None = None
        self.failed_from: int | None = None  # first layer that did not complete

    @contextmanager
    def guard(self) -> Iterator[None]:
        """``with run.guard():`` runs its body only if the run is not cancelled (raises
        :class:`Cancelled` otherwise), and :meth:`cancel` waits for the body to end."""
        with self._guard:
            if self.cancelled:
                raise Cancelled("the run was cancelled")
            yield

    def cancel(self) -> None:
        """Give up on the run: waiters are released (as failed) and no step runs from now on."""
        with self._guard:
            self.cancelled = True
            self._stop_at(next((i for i, ev in enumerate(self._events) if not ev.is_set()), self.layers))

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """True when layer ``layer`` was restored; False if it failed or ``timeout`` passed."""
        if not self._events[layer].wait(timeout):
            return False
        return self.failed_from is None or layer < self.failed_from

    def reached(self, layer: int) -> bool:
        """Layer ``layer`` is restored, failed or given up on (a ``wait`` would not block)."""
        return self._events[layer].is_set()

    def join(self, timeout: float | None = None) -> bool:
        return self._finished.wait(timeout)

    @property
    def ok(self) -> bool:
        return self._finished.is_set() and self.failed_from is None

    def _fail(self, layer: int, exc: BaseException) -> None:
        self.error = exc
        self._stop_at(layer)

    def _stop_at(self, layer: int) -> None:
        """Layers from ``layer`` on did not complete: release their waiters."""
        if self.failed_from is None or layer < self.failed_from:
            self.failed_from = layer
        for ev in self._events[layer:]:
            ev.set()


_Item = tuple[LayerRun, Callable[[int], None], Callable[[], None] | None]


class LayerPipeline:
    """Runs ``before()`` then ``step(0) .. step(layers-1)`` for each submitted run, in order,
    on one long-lived thread. A failing ``before`` or ``step`` fails the rest of that run."""

    def __init__(self, name: str = "kvtier-layers", thread_init: Callable[[], None] | None = None) -> None:
        self._thread_init = thread_init
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def start(self, layers: int, step: Callable[[int], None],
              before: Callable[[], None] | None = None) -> LayerRun:
        run = LayerRun(layers)
        self._queue.put((run, step, before))
        return run

    def _loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, step, before = item
            layer = 0
            try:
                if before is not None:
                    before()
                for layer in range(run.layers):
                    with run.guard():
                        step(layer)
                        run._events[layer].set()
            except Cancelled:
                log.debug("layer restore cancelled before layer %d", layer)
            except Exception as exc:  # noqa: BLE001 - any failure must release the waiters
                log.warning("layer restore failed at layer %d: %s", layer, exc)
                run._fail(layer, exc)
            finally:
                run._finished.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

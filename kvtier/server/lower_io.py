"""Background I/O between a node's tiers and its lower tier (kvtier.server.lower): the bounded
write-through queue and the lookup-time prefetch. Both own one thread (pool) each and never
make a request wait on Redis longer than the tier's own deadline.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures

from kvtier.tiers.base import Entry, Tier

log = logging.getLogger(__name__)

_BATCH_CHUNKS = 64          # chunks per Redis round trip from the writer
_BATCH_BYTES = 16 << 20     # ... and at most this many bytes
WRITE_OUTCOMES = ("queued", "written", "dropped", "failed")


class WriteThrough:
    """A bounded queue of chunk copies drained into ``tier`` by one daemon thread.

    ``offer`` never blocks on the tier: what does not fit in ``max_bytes`` is dropped and
    counted. Bytes stay counted against the bound until the tier call that takes them
    returns, so the bound covers what is in flight too."""

    def __init__(self, tier: Tier, max_bytes: int, name: str) -> None:
        self.tier = tier
        self.max_bytes = max_bytes
        self._cond = threading.Condition()
        self._items: deque[Entry] = deque()
        self._bytes = 0
        self._busy = False
        self._closing = False
        self._abandon = False
        self.counts: Counter[str] = Counter({k: 0 for k in WRITE_OUTCOMES})
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    def offer(self, entries: Iterable[Entry]) -> None:
        # Copy outside the lock: the caller may reuse its buffers (shm segment) on return.
        copies = [Entry(e.key, bytes(e.data), e.depth, e.parent) for e in entries]
        if not copies:
            return
        with self._cond:
            for e in copies:
                n = len(e.data)
                if self._closing or self._bytes + n > self.max_bytes:
                    self.counts["dropped"] += 1
                    continue
                self._items.append(e)
                self._bytes += n
                self.counts["queued"] += 1
            self._cond.notify_all()

    def discard(self, keys: Sequence[bytes]) -> None:
        """Forget queued (not yet sent) chunks of ``keys``: a Delete must not be undone."""
        gone = set(keys)
        with self._cond:
            kept = [e for e in self._items if e.key not in gone]
            for e in self._items:
                if e.key in gone:
                    self._bytes -= len(e.data)
            self._items = deque(kept)

    def _take(self) -> list[Entry] | None:
        with self._cond:
            while not self._items and not self._closing:
                self._cond.wait()
            if not self._items or self._abandon:
                return None
            batch: list[Entry] = []
            size = 0
            while self._items and len(batch) < _BATCH_CHUNKS and size < _BATCH_BYTES:
                e = self._items.popleft()
                batch.append(e)
                size += len(e.data)
            self._busy = True
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            try:
                ok = self.tier.put(batch)  # the tier contract: failures are False, never raised
            except Exception:  # a tier that breaks it costs this batch, not the thread (logged)
                log.exception("lower tier %s: a put raised; its batch of %d is dropped", self.tier.name, len(batch))
                ok = [False] * len(batch)
            with self._cond:
                self._bytes -= sum(len(e.data) for e in batch)
                self.counts["written"] += sum(ok)
                self.counts["failed"] += len(ok) - sum(ok)
                self._busy = False
                self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far has been handed to the tier; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._items and not self._busy, timeout)

    def close(self, drain_s: float) -> None:
        """Stop taking chunks, give the queue ``drain_s`` to drain, drop (and count) the rest."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(drain_s)
        with self._cond:
            self._abandon = True
            self.counts["dropped"] += len(self._items)
            self._bytes -= sum(len(e.data) for e in self._items)
            self._items.clear()
            self._cond.notify_all()
        self._thread.join(drain_s)

    def snapshot(self) -> dict[str, int]:
        with self._cond:
            return {**self.counts, "queue_bytes": self._bytes, "queue_chunks": len(self._items)}


class Prefetcher:
    """Reads the chunks a lookup found in the lower tier into the node's tiers in the
    background, so that the Get which usually follows a lookup is served from RAM rather
    than one Redis round trip per chunk (the shm path asks for chunks one at a time).

    At most ``max_keys`` keys are in flight; a lookup beyond that prefetches nothing (the
    Get then reads Redis itself). A Get for a key in flight waits for it (``wait``)."""

    def __init__(self, fetch: Callable[[list[bytes]], object], name: str, max_keys: int = 4096) -> None:
        self._fetch = fetch
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._inflight: dict[bytes, Future[object]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def start(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            new = [k for k in dict.fromkeys(keys) if k not in self._inflight]
            if not new or len(self._inflight) + len(new) > self._max_keys:
                return
            future = self._pool.submit(self._fetch, new)
            for k in new:
                self._inflight[k] = future
        future.add_done_callback(lambda _f: self._done(new))

    def _done(self, keys: list[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._inflight.pop(k, None)

    def wait(self, keys: Sequence[bytes], timeout: float) -> None:
        if not self._inflight:  # the common case: nothing in flight, no lock taken
            return
        with self._lock:
            pending = {f for k in keys if (f := self._inflight.get(k)) is not None}
        if pending:
            wait_futures(pending, timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

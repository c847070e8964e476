"""The store's write-behind: chunks bound for the tiers below tier 0, written by one thread.

A job is (entries, first level, prefix keys). :meth:`WriteBehind.enqueue` never blocks: when the
bounded queue is full the batch is dropped and counted (the engine is never stalled by a slow
lower tier). The writer thread puts each job into its level and, when ``cascade``, every level
below it (``write_through`` and ``write_through_selective``; ``write_back`` moves one level per
eviction instead).

Deletes win over queued writes: :meth:`forget` marks keys, and a job queued before the mark
writes none of them (else a chunk deleted as corrupt, or purged as computed over bad blocks,
came back from the queue after ``delete`` returned); a key marked while its job was being
written into a tier is removed from that tier again (``remove``). Marks are dropped once no
job queued before them is left.

``write_back`` hands a tier's evicted chunk down as ``(key, bytes)`` only (the evict listener's
contract): :class:`Lineage` is the store's memory of each chunk's depth and parent, so the
tier below is told them as the tier above was (prefix-aware policies evict leaves first).
:class:`LoadCounts` decides which loaded chunks ``write_through_selective`` writes down.

Threads: ``enqueue``/``forget``/``flush``/``close`` from any thread; ``write(level, entries,
prefix)`` and ``remove(level, keys, prefix)`` run on the writer thread only. Failure: a
``write`` that raises costs that job (logged, counted ``error`` through ``on_drop``), never
the thread (flush and close would hang).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from kvtier.tiers.base import Entry

log = logging.getLogger(__name__)

Write = Callable[[int, list[Entry], Sequence[bytes] | None], None]
Remove = Callable[[int, list[bytes], Sequence[bytes] | None], None]
_STOP = object()
# (entries, first level, prefix keys when known, sequence number when queued)
_Job = tuple[list[Entry], int, Sequence[bytes] | None, int]


class WriteBehind:
    def __init__(self, levels: int, depth: int, write: Write, remove: Remove, cascade: bool,
                 on_drop: Callable[[int, str, int], None], on_depth: Callable[[int], None]) -> None:
        """``levels``: tiers in the store; ``on_drop(level, reason, n)``: n chunks bound for
        ``level`` not written (``closed``, ``queue_full``, ``error``); ``on_depth(n)``: the
        queue's length after each change."""
        self._levels, self._write, self._remove, self._cascade = levels, write, remove, cascade
        self._on_drop, self._on_depth = on_drop, on_depth
        self._queue: queue.Queue[_Job | object] = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()  # the closed flag, sequence numbers, delete marks
        self._closed = False
        self._seq = 0
        self._deleted: dict[bytes, int] = {}  # key -> sequence number of its latest delete
        self._marks: deque[tuple[int, bytes]] = deque()  # (sequence number, key), oldest first
        self._thread = threading.Thread(target=self._loop, name="kvtier-store-writer", daemon=True)
        self._thread.start()

    def enqueue(self, entries: list[Entry], level: int, prefix: Sequence[bytes] | None) -> None:
        with self._lock:  # close() sets _closed under it: nothing lands behind _STOP
            if self._closed:  # a store() that raced close(): its write-down is not taken
                self._on_drop(level, "closed", len(entries))
                return
            self._seq += 1
            try:
                self._queue.put_nowait((entries, level, prefix, self._seq))
            except queue.Full:
                self._on_drop(level, "queue_full", len(entries))
                return
        self._on_depth(self._queue.qsize())

    def forget(self, keys: Sequence[bytes]) -> None:
        """Queued writes of ``keys`` are not done (a delete of them happened after they were queued)."""
        with self._lock:
            if self._queue.unfinished_tasks == 0:
                return
            self._seq += 1
            for key in keys:
                self._deleted[key] = self._seq
                self._marks.append((self._seq, key))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job is written; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> bool:
        """Write what is queued, then stop the thread. False if it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
        # Outside the lock: a full queue waits for the writer, which may itself be enqueueing
        # (an eviction's write-back) and need the lock to see that we are closed.
        self._queue.put(_STOP)
        self._thread.join()
        return True

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                assert isinstance(item, tuple)
                job: _Job = item
                try:
                    self._write_job(*job)
                except Exception:  # a tier broke its contract; without this thread, flush() and close() hang
                    log.exception("write-behind into level %d failed; that batch is dropped", job[1])
                    self._on_drop(job[1], "error", len(job[0]))
            finally:
                self._queue.task_done()
                self._on_depth(self._queue.qsize())

    def _write_job(self, entries: list[Entry], level: int, prefix: Sequence[bytes] | None, seq: int) -> None:
        self._prune(seq)
        for at in range(level, self._levels if self._cascade else level + 1):
            entries = self._not_deleted(entries, seq)
            if not entries:
                return
            self._write(at, entries, prefix)
            kept = self._not_deleted(entries, seq)
            if len(kept) < len(entries):  # deleted while this tier took them: take them back
                still = {e.key for e in kept}
                self._remove(at, [e.key for e in entries if e.key not in still], prefix)
            entries = kept

    def _prune(self, seq: int) -> None:
        """Marks at or below ``seq`` apply to jobs queued before them, all written by now."""
        with self._lock:
            marks, deleted = self._marks, self._deleted
            while marks and marks[0][0] <= seq:
                at, key = marks.popleft()
                if deleted.get(key) == at:
                    del deleted[key]

    def _not_deleted(self, entries: list[Entry], seq: int) -> list[Entry]:
        with self._lock:
            if not self._deleted:
                return entries
            deleted = self._deleted
            return [e for e in entries if deleted.get(e.key, 0) <= seq]


class Lineage:
    """Depth and parent of the chunks put into tiers that write back, for the write-back of
    each when it is evicted: ``entry(key, data)``. A store listener (``chunks_stored``), so it
    sees every put the store makes (a save, a promotion, a write-down) before it runs; it
    keeps those into ``tiers`` (the ones that write back). Bounded: past ``limit`` keys (~200
    bytes each) the least recently stored are forgotten (their write-back then carries no
    parent, as before this existed); an entry never goes stale, as a key (a chained hash of
    its whole prefix) has one parent and one depth. Any thread."""

    def __init__(self, tiers: Sequence[str], limit: int = 1 << 16) -> None:
        self._tiers = frozenset(tiers)
        self._limit = limit
        self._links: OrderedDict[bytes, tuple[int, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def chunks_stored(self, tier: str, entries: Sequence[Entry]) -> None:
        if tier not in self._tiers:
            return
        links = self._links
        with self._lock:
            for e in entries:
                if e.depth or e.parent:
                    links[e.key] = (e.depth, e.parent)
                    links.move_to_end(e.key)
            while len(links) > self._limit:
                links.popitem(last=False)

    def chunks_removed(self, tier: str, keys: Sequence[bytes]) -> None:
        """Kept: the key may still be held by another tier that writes back (see above)."""

    def entry(self, key: bytes, data: bytes) -> Entry:
        """The evicted chunk ``key`` as an :class:`Entry` for the tier below."""
        with self._lock:
            depth, parent = self._links.get(key, (0, b""))
        return Entry(key, data, depth, parent)


def first_link(keys: Sequence[bytes], prefix: Sequence[bytes] | None) -> tuple[int, bytes]:
    """Depth and parent of ``keys[0]``, the first of a run of consecutive chunks of the prefix
    whose keys are ``prefix`` (``prefix[d]`` is chunk d; a loader may read a long prefix a
    batch at a time): its index there and the key before it, or (0, b"") when the caller gave
    no prefix or one without it."""
    if not keys or not prefix or prefix[0] == keys[0]:
        return 0, b""
    try:
        d0 = prefix.index(keys[0])
    except ValueError:
        return 0, b""
    return d0, prefix[d0 - 1]


HITS_REMEMBERED = 1 << 16  # keys whose load count LoadCounts keeps (~200 B each)


class LoadCounts:
    """``write_through_selective``'s memory of how often each chunk was loaded: :meth:`due`
    counts a load and returns the chunks whose count just reached ``min_hits`` (the store's
    config, read at each call), as entries for the tiers below (copies, with depth and
    parent). Bounded: past :data:`HITS_REMEMBERED` keys the least recently loaded are
    forgotten (their count starts again). Any thread."""

    def __init__(self) -> None:
        self._hits: OrderedDict[bytes, int] = OrderedDict()  # most recently loaded last
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._hits)

    def due(self, keys: Sequence[bytes], run: Sequence[bytes | bytearray | memoryview],
            prefix: Sequence[bytes] | None, min_hits: int) -> list[Entry]:
        """Count one load of ``keys[:len(run)]`` (``run`` their chunks, consecutive chunks of
        ``prefix``)."""
        due: list[Entry] = []
        hits = self._hits
        d0, lead = first_link(keys, prefix)
        with self._lock:
            for i, data in enumerate(run):
                n = hits.pop(keys[i], 0) + 1
                hits[keys[i]] = n
                if n == min_hits:
                    # The queue keeps the entry: a copy, as ``run`` may be the caller's buffers.
                    due.append(Entry(keys[i], data if isinstance(data, bytes) else bytes(data), d0 + i,
                                     keys[i - 1] if i else lead))
            while len(hits) > HITS_REMEMBERED:  # bounded: the least recently loaded go
                hits.popitem(last=False)
        return due

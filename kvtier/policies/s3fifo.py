"""S3-FIFO (Yang et al., SOSP '23): three FIFO queues, a comparison point for the default.

- New keys enter the small queue S (target: 10% of the tracked size); a key evicted from S
  that was not read while there leaves a ghost entry in G; a key read while in S moves to the
  main queue M instead.
- A key inserted while its ghost is in G goes straight to M.
- M is a FIFO with reinsertion: a key at its head with ``freq > 0`` goes back with
  ``freq - 1`` (freq counts reads, capped at 3); one with ``freq == 0`` is evicted.
- G remembers as many keys as M can hold (90% of the tracked keys).

The policy never sees the tier's capacity: ``evict`` is only called when the tier is full, so
the tracked size stands in for it. Not prefix-aware (``depth``/``parent`` are ignored).
Pinned keys are taken out of their queue (so ``evict`` never walks over them) and go back to
its tail when unpinned. Thread-safety and purity as in :mod:`kvtier.policies.base`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import NothingToEvict

SMALL_FRACTION = 0.1
MAX_FREQ = 3
_SMALL, _MAIN = 0, 1


class _Entry:
    __slots__ = ("freq", "queue", "size")

    def __init__(self, size: int, queue: int) -> None:
        self.size = size
        self.freq = 0
        self.queue = queue


class S3FIFOPolicy:
    name = "s3fifo"

    def __init__(self) -> None:
        self._entries: dict[bytes, _Entry] = {}
        self._small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: set[bytes] = set()
        self._small_size = 0  # bytes of S, pinned members included
        self._total_size = 0

    def _queue(self, e: _Entry) -> OrderedDict[bytes, None]:
        return self._small if e.queue == _SMALL else self._main

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        size = max(0, int(size))
        e = self._entries.get(key)
        if e is not None:
            self._resize(e, size)
            self.access(key)
            return
        if key in self._ghost:
            del self._ghost[key]
            e = _Entry(size, _MAIN)
        else:
            e = _Entry(size, _SMALL)
            self._small_size += size
        self._entries[key] = e
        self._total_size += size
        if key not in self._pinned:
            self._queue(e)[key] = None

    def _resize(self, e: _Entry, size: int) -> None:
        self._total_size += size - e.size
        if e.queue == _SMALL:
            self._small_size += size - e.size
        e.size = size

    def access(self, key: bytes) -> None:
        e = self._entries.get(key)
        if e is not None and e.freq < MAX_FREQ:
            e.freq += 1

    def remove(self, key: bytes) -> None:
        e = self._entries.pop(key, None)
        if e is None:
            return
        self._queue(e).pop(key, None)  # absent when pinned
        self._drop(e)

    def forget_evicted(self, key: bytes) -> None:
        """Another policy tracking the same keys evicted ``key`` (kvtier.policies.dueling):
        stop tracking it as this one would have evicted it (a key evicted from S unread
        leaves a ghost). Unknown keys are ignored."""
        e = self._entries.pop(key, None)
        if e is None:
            return
        self._queue(e).pop(key, None)  # absent when pinned
        if e.queue == _SMALL and e.freq == 0:
            self._ghost[key] = None
            self._trim_ghost()
        self._drop(e)

    def _drop(self, e: _Entry) -> None:
        self._total_size -= e.size
        if e.queue == _SMALL:
            self._small_size -= e.size

    def evict(self) -> bytes:
        small, main = self._small, self._main
        # Each pass either evicts or spends one read of credit (a move S -> M, or a freq - 1
        # reinsertion in M), so the loop ends and costs O(1) amortised per access.
        while small or main:
            if small and (self._small_size >= SMALL_FRACTION * self._total_size or not main):
                key, _ = small.popitem(last=False)
                e = self._entries[key]
                if e.freq > 0:
                    e.freq = 0
                    e.queue = _MAIN
                    self._small_size -= e.size
                    main[key] = None
                    continue
                self._ghost[key] = None
                self._trim_ghost()
            else:
                key, _ = main.popitem(last=False)
                e = self._entries[key]
                if e.freq > 0:
                    e.freq -= 1
                    main[key] = None
                    continue
            del self._entries[key]
            self._drop(e)
            return key
        raise NothingToEvict("every tracked key is pinned")

    def _trim_ghost(self) -> None:
        limit = max(1, int((1 - SMALL_FRACTION) * len(self._entries)))
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def pin(self, key: bytes) -> None:
        if key in self._pinned:
            return
        self._pinned.add(key)
        e = self._entries.get(key)
        if e is not None:
            del self._queue(e)[key]

    def unpin(self, key: bytes) -> None:
        if key not in self._pinned:
            return
        self._pinned.discard(key)
        e = self._entries.get(key)
        if e is not None:
            self._queue(e)[key] = None

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

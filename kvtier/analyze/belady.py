"""Belady's MIN as an eviction policy: the offline reference on each capacity.

It knows the whole access sequence of a replay (:func:`kvtier.analyze.replay.access_sequence`)
and evicts the tracked key whose next use is farthest away. Every ``insert``/``access`` must be
the next access of that sequence, in order (the replay loop guarantees it; a mismatch raises
AssertionError). Under the leading-run rule an ancestor chunk is always used no later than its
descendants, so MIN trims prefixes from the tail, as the rule wants. MIN is optimal for hits
counted per key; with hits counted as leading runs it is not a bound (an online policy beat it
by 1.2 points on a round-robin agent workload), only a strong reference. Not an online policy:
it is only ever used by the analysis, never by a tier.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvtier.policies import NothingToEvict


class BeladyPolicy:
    name = "belady"

    def __init__(self, seq: Sequence[bytes]) -> None:
        never = len(seq)
        self._next = [never] * len(seq)
        last: dict[bytes, int] = {}
        for t in range(len(seq) - 1, -1, -1):
            self._next[t] = last.get(seq[t], never)
            last[seq[t]] = t
        self._seq = seq
        self._t = 0
        self._due: dict[bytes, int] = {}  # tracked key -> its next use
        self._heap: list[tuple[int, bytes]] = []  # (-next use, key); stale entries skipped lazily

    def _touch(self, key: bytes) -> None:
        t = self._t
        if self._seq[t] != key:
            raise AssertionError(f"access {t} is {key!r}, the sequence says {self._seq[t]!r}")
        self._t = t + 1
        due = self._next[t]
        self._due[key] = due
        heapq.heappush(self._heap, (-due, key))

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        self._touch(key)

    def access(self, key: bytes) -> None:
        self._touch(key)

    def remove(self, key: bytes) -> None:
        self._due.pop(key, None)

    def evict(self) -> bytes:
        while self._heap:
            due, key = heapq.heappop(self._heap)
            if self._due.get(key) == -due:
                del self._due[key]
                return key
        raise NothingToEvict("nothing tracked")

    def pin(self, key: bytes) -> None:
        raise NotImplementedError("the offline optimum takes no pins")

    def unpin(self, key: bytes) -> None:
        raise NotImplementedError("the offline optimum takes no pins")

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def __len__(self) -> int:
        return len(self._due)

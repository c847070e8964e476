"""Least recently used: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import NothingToEvict


class LRUPolicy:
    """Least recently used; the baseline every other policy is measured against.

    Pinned keys are held outside the recency order (so ``evict`` never walks over them);
    unpinning a key counts as a use of it.
    """

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()  # unpinned keys, oldest first
        self._held: set[bytes] = set()  # tracked and pinned
        self._pinned: set[bytes] = set()

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        if key in self._pinned:
            self._held.add(key)
            return
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)
        self._held.discard(key)

    def evict(self) -> bytes:
        if not self._order:
            raise NothingToEvict("every tracked key is pinned")
        key, _ = self._order.popitem(last=False)
        return key

    def pin(self, key: bytes) -> None:
        self._pinned.add(key)
        if key in self._order:
            del self._order[key]
            self._held.add(key)

    def unpin(self, key: bytes) -> None:
        self._pinned.discard(key)
        if key in self._held:
            self._held.discard(key)
            self._order[key] = None

    def __contains__(self, key: object) -> bool:
        return key in self._order or key in self._held

    def __len__(self) -> int:
        return len(self._order) + len(self._held)

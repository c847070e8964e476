"""Eviction policies: pure bookkeeping, no I/O, no locks (the owning tier serialises calls).

A policy tracks keys and picks victims; it never sees bytes. Every policy supports pinning:
a pinned key is never chosen as a victim (hot system prompts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol


class NothingToEvict(Exception):
    """Every tracked key is pinned (or nothing is tracked): no victim can be chosen."""


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        """Start tracking ``key`` (re-inserting a tracked key counts as an access)."""

    def access(self, key: bytes) -> None:
        """``key`` was read; unknown keys are ignored."""

    def remove(self, key: bytes) -> None:
        """Stop tracking ``key`` (deleted by the user); unknown keys are ignored."""

    def evict(self) -> bytes:
        """Choose a victim, stop tracking it and return it; raise NothingToEvict if none."""

    def pin(self, key: bytes) -> None:
        """Never evict ``key`` until unpinned (pinning an untracked key is remembered)."""

    def unpin(self, key: bytes) -> None: ...

    def __contains__(self, key: object) -> bool: ...

    def __len__(self) -> int: ...


class LRUPolicy:
    """Least recently used; the baseline every other policy is measured against."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: set[bytes] = set()

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(self) -> bytes:
        for key in self._order:
            if key not in self._pinned:
                del self._order[key]
                return key
        raise NothingToEvict("every tracked key is pinned")

    def pin(self, key: bytes) -> None:
        self._pinned.add(key)

    def unpin(self, key: bytes) -> None:
        self._pinned.discard(key)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}
DEFAULT_POLICY = "lru"


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}") from None

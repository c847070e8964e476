"""The eviction-policy contract, implemented by every module of :mod:`kvtier.policies`.

Contract for every policy:
- Pure bookkeeping: no I/O, no locks, no wall clock (a logical clock ticks once per insert or
  access), deterministic (same call sequence, same victims, in every process).
- Not thread-safe: the owning tier serialises every call under its own lock.
- Tracks keys only, never bytes; ``size`` is the key's footprint in the tier's units.
- Pinning: a pinned key is never returned by ``evict``. Pins are remembered per key, whether or
  not the key is tracked, until ``unpin``; removing or evicting a key does not unpin it.
- ``evict`` stops tracking the victim and returns it; it raises :class:`NothingToEvict` only
  when every tracked key is pinned (or nothing is tracked), so repeated calls eventually return
  every tracked, unpinned key.
- Each operation is O(1) or O(log n) (amortised) in the number of tracked keys.
"""

from __future__ import annotations

from typing import Protocol


class NothingToEvict(Exception):
    """Every tracked key is pinned (or nothing is tracked): no victim can be chosen."""


class EvictionPolicy(Protocol):
    name: str

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        """Start tracking ``key`` (re-inserting a tracked key counts as an access).

        ``depth`` is the chunk's index in its prefix and ``parent`` the key of the chunk before
        it (b"" for the first chunk). Prefix-aware policies use them; others ignore them.
        """

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

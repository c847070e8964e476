"""What the store's in-process tiers hold, asked from the forward thread.

The capture asks, before it claims a chunk for saving, how many leading chunk keys the
store already holds; only in-process tiers (cpu, memory, disk) are asked there, as a probe of
those costs microseconds. A remote tier is not asked from the forward thread: the saver's own
lookup skips what it holds, and :func:`probes_every_tier` tells the saver when that lookup
can be left out (every tier was probed already).

Threads: both functions only read the tiers' indexes (thread-safe probes); no state here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.store import TieredStore
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier

LOCAL_TIERS = (CpuTier, MemoryTier, DiskTier)  # in-process tiers: a probe costs microseconds


def probes_every_tier(store: TieredStore) -> bool:
    """Whether :func:`held_locally` asks every tier of ``store``."""
    return all(isinstance(t, LOCAL_TIERS) for t in store.tiers)


def held_locally(store: TieredStore, keys: Sequence[bytes]) -> int:
    """How many leading ``keys`` the store's leading in-process tiers hold (each tier asked
    for the keys after those the tiers before it hold)."""
    pos = 0
    for tier in store.tiers:
        if pos >= len(keys) or not isinstance(tier, LOCAL_TIERS):
            break
        pos += tier.probe(keys[pos:]).hits
    return pos

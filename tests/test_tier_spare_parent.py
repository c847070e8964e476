"""A put never evicts the chunk it extends, in every bounded tier and under every policy.

Keys chain the whole prefix, so a chunk whose parent is gone can never be hit (a lookup stops
at the gap). A full tier making room for chunk d+1 of a chain used to be free to evict chunk d:
a leaf-first policy sees the newest chunk of the chain being written as a leaf, LRU sees it as
older than a chunk read since. The child was then stored anyway, unreachable (an audit's
round-robin chat replay: up to 4,891 such self-evictions, 0.936x LRU's hit ratio at 5%).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.policies import POLICIES
from kvtier.tiers.base import BoundedTier, Entry
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from tests.contract import chunk_for, key_of

Make = Callable[[Path, str, int], BoundedTier]


def _memory(path: Path, policy: str, one: int) -> BoundedTier:
    return MemoryTier(capacity_bytes=2 * one + 10, name="m", policy=policy)


def _cpu(path: Path, policy: str, one: int) -> BoundedTier:
    slot = -(-one // 4096) * 4096
    return CpuTier(CpuTierConfig(capacity_bytes=2 * slot, slot_bytes=slot, policy=policy, pin_memory="never"))


def _disk(path: Path, policy: str, one: int) -> BoundedTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=2 * one + 10, policy=policy, o_direct=False))


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("make", [_memory, _cpu, _disk], ids=["memory", "cpu", "disk"])
def test_a_put_does_not_evict_its_own_parent(tmp_path: Path, policy: str, make: Make) -> None:
    parent, other, child = key_of("chain-0"), key_of("other-0"), key_of("chain-1")
    one = len(chunk_for(parent))
    tier = make(tmp_path, policy, one)
    assert tier.put([Entry(parent, chunk_for(parent), 0, b"")]) == [True]
    assert tier.put([Entry(other, chunk_for(other), 0, b"")]) == [True]
    for _ in range(3):  # the other chain is read since: the most recent, and re-used
        tier.get([other])
    assert tier.put([Entry(child, chunk_for(child), 1, parent)]) == [True]  # full: one must go
    assert tier.contains([parent, child]) == 2, "the chain's own parent was evicted for it"
    assert tier.contains([other]) == 0
    assert tier.check() == []


def test_a_put_whose_parent_is_pinned_or_absent_still_evicts(tmp_path: Path) -> None:
    """Sparing adds no pin of its own: a user pin stays, an absent parent spares nothing."""
    one = len(chunk_for(key_of("a")))
    tier = MemoryTier(capacity_bytes=2 * one + 10, name="m", policy="lru")
    a, b, c, d = (key_of(n) for n in "abcd")
    tier.put([Entry(a, chunk_for(a)), Entry(b, chunk_for(b))])
    tier.pin([a])
    assert tier.put([Entry(c, chunk_for(c), 1, a)]) == [True]  # b goes (a is pinned anyway)
    assert tier.contains([a]) == 1 and tier.contains([c]) == 1
    tier.unpin([a])
    assert tier.put([Entry(d, chunk_for(d), 5, key_of("elsewhere"))]) == [True]  # one of a, c goes
    assert tier.contains([d]) == 1 and tier.usage().entries == 2
    assert tier.check() == []

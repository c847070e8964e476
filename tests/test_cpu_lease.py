"""CpuTier.leased: a zero-copy view of a chunk that no eviction, delete or overwrite can reuse
while it is held (the server sends such views straight to sockets)."""

from __future__ import annotations

from kvtier.config import CpuTierConfig
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.cpu import CpuTier

SLOT = 4096


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_leased_chunk_survives_eviction_delete_and_overwrite() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=2 * SLOT, slot_bytes=SLOT, policy="lru"))
    assert tier.put([Entry(_key(1), b"a" * 1000)]) == [True]
    with tier.leased(_key(1)) as view:
        assert isinstance(view, memoryview) and view.readonly and bytes(view) == b"a" * 1000
        tier.put([Entry(_key(1), b"b" * 1000)])  # overwrite: goes to another slot
        tier.delete([_key(1)])
        for i in range(2, 6):  # churn every free slot
            tier.put([Entry(_key(i), bytes([i]) * 1000)])
        assert bytes(view) == b"a" * 1000  # the leased slot was never handed out
        assert tier.usage().entries == 1  # one slot leased (retired), one usable
    assert tier.check() == []
    # The slot is back: both slots hold chunks again.
    assert all(tier.put([Entry(_key(9), b"z" * 10), Entry(_key(10), b"y" * 10)]))
    assert tier.usage().entries == 2
    tier.close()


def test_lease_of_an_absent_key_yields_its_miss() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=2 * SLOT, slot_bytes=SLOT))
    with tier.leased(_key(7)) as view:
        assert isinstance(view, Miss) and view.reason == "absent"
    tier.close()

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


def test_leased_many_holds_every_slot_under_churn() -> None:
    """The server leases a GET's RAM hits together and sends them with one sendmsg: every view
    stays intact until the block ends, a miss is a Miss in its place."""
    tier = CpuTier(CpuTierConfig(capacity_bytes=4 * SLOT, slot_bytes=SLOT, policy="lru"))
    assert tier.put([Entry(_key(i), bytes([i]) * 500) for i in (1, 2)]) == [True, True]
    with tier.leased_many([_key(1), _key(3), _key(2)]) as views:
        assert isinstance(views[1], Miss)
        for i in range(10, 20):  # evicts, overwrites: never into a leased slot
            tier.put([Entry(_key(i), bytes([i]) * 500)])
        tier.put([Entry(_key(2), b"x" * 500)])
        assert [bytes(v) for v in (views[0], views[2])] == [b"\x01" * 500, b"\x02" * 500]
        assert all(v.readonly for v in (views[0], views[2]))  # type: ignore[union-attr]
    assert tier.check() == []
    assert all(tier.put([Entry(_key(i), b"z" * 10) for i in range(30, 34)]))  # all 4 slots usable
    tier.close()


def test_a_reserved_slot_is_invisible_until_committed_and_abort_frees_it() -> None:
    """The server receives a PUT's chunk straight into a reserved slot and publishes it only
    after verifying it: before commit no reader sees it (the old chunk of that key stays),
    abort gives the slot back, commit replaces the key's old chunk, and a reservation takes
    only a free slot (an unverified chunk never evicts)."""
    tier = CpuTier(CpuTierConfig(capacity_bytes=2 * SLOT, slot_bytes=SLOT, policy="lru"))
    assert tier.put([Entry(_key(1), b"old" * 10)]) == [True]
    assert tier.reserve(SLOT + 1) is None  # does not fit a slot
    res = tier.reserve(30)
    assert res is not None and res.view.nbytes == 30 and not res.view.readonly
    res.view[:] = b"new" * 10
    assert tier.get([_key(1)]) == [b"old" * 10]  # unpublished
    assert tier.check() == []  # a reserved slot is accounted for
    tier.abort(res)
    assert tier.get([_key(1)]) == [b"old" * 10]
    res = tier.reserve(30)
    assert res is not None
    res.view[:] = b"new" * 10
    assert tier.commit(res, _key(1)) is True
    assert tier.get([_key(1)]) == [b"new" * 10] and tier.usage().entries == 1
    assert tier.check() == []
    spare = tier.reserve(10)  # the slot key 1's old chunk left: no slot was lost on the way
    assert spare is not None
    assert tier.reserve(10) is None  # the only other slot holds key 1: a reservation never evicts
    assert tier.get([_key(1)]) == [b"new" * 10]
    tier.abort(spare)
    assert tier.check() == [] and tier.usage().entries == 1
    tier.close()

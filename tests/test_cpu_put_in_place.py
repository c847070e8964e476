"""CpuTier.put_in_place: a chunk written straight into its arena slot by the caller's fill."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvtier.config import CpuTierConfig
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.cpu import CpuTier

SLOT = 4096


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def _fill(byte: int) -> Callable[[memoryview], None]:
    def fill(view: memoryview) -> None:
        view[:] = bytes([byte]) * view.nbytes
    return fill


def test_filled_chunk_reads_back_and_is_evicted_like_any_other() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=2 * SLOT, slot_bytes=SLOT, policy="lru"))
    assert tier.put_in_place(_key(1), 1000, _fill(7))
    assert tier.get([_key(1)]) == [b"\x07" * 1000]
    assert tier.put([Entry(_key(2), b"b" * 10)]) == [True]
    assert tier.put_in_place(_key(3), 300, _fill(9))          # evicts the oldest (key 1)
    assert isinstance(tier.get([_key(1)])[0], Miss)
    assert tier.get([_key(3)]) == [b"\x09" * 300]
    assert tier.put_in_place(_key(3), 20, _fill(1))           # overwrite
    assert tier.get([_key(3)]) == [b"\x01" * 20]
    assert not tier.put_in_place(_key(4), SLOT + 1, _fill(1))  # larger than a slot: refused
    assert tier.check() == []
    tier.close()


def test_a_failing_fill_stores_nothing_and_frees_its_slot() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=SLOT, slot_bytes=SLOT, policy="lru"))

    def boom(view: memoryview) -> None:
        view[:4] = b"half"
        raise OSError("source went away")

    with pytest.raises(OSError, match="went away"):
        tier.put_in_place(_key(1), 100, boom)
    assert isinstance(tier.get([_key(1)])[0], Miss) and tier.usage().entries == 0
    assert tier.put_in_place(_key(2), 100, _fill(3))          # the one slot is usable again
    assert tier.check() == []
    tier.close()

"""CpuTier.shed and the lazily backed arena (kvtier-server's RAM pool, issue 10 "Tenant
memory"): shed evicts in the tier's own policy order, and a lazy arena's resident pages
follow the chunks it holds — measured with mincore(2), never assumed — while a slot
being read keeps its pages and bytes until its reader leaves."""

from __future__ import annotations

import ctypes
import logging
import mmap
from pathlib import Path

import numpy as np
import pytest

from kvtier.config import CpuTierConfig
from kvtier.pinned import HUGE_PAGE
from kvtier.tiers.base import EVICTED, Entry, Miss
from kvtier.tiers.cpu import CpuTier

SLOT = 64 << 10  # a page multiple: every page of a slot is its own
MiB = 1 << 20


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _chunk(i: int, n: int = 60_000) -> bytes:
    return bytes([i % 251]) * n


def arena_rss(tier: CpuTier) -> int:
    """Resident bytes of ``tier``'s arena, page by page from mincore(2): exact to the arena
    (/proc/self/smaps would report the whole VMA, which the kernel may merge with adjacent
    private anonymous memory)."""
    arena = np.frombuffer(tier._arena, dtype=np.uint8)
    pages = -(-arena.nbytes // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(arena.ctypes.data), ctypes.c_size_t(arena.nbytes), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def test_shed_evicts_in_policy_order_and_returns_bytes_freed() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=8 * SLOT, slot_bytes=SLOT, policy="lru", pin_memory="never"),
                   lazy=True)
    seen: list[bytes] = []
    tier.evict_listener = lambda key, data: seen.append(key)
    assert tier.put([Entry(_key(i), _chunk(i)) for i in range(6)]) == [True] * 6
    tier.get([_key(0)])  # 0 is now the most recently used
    tier.pin([_key(1)])
    assert tier.shed(100_000) == 120_000  # whole chunks until >= 100_000: 2 and 3 (1 is pinned)
    assert seen == [_key(2), _key(3)]
    assert tier.get([_key(2)]) == [Miss(EVICTED)] and tier.get([_key(0)]) == [_chunk(0)]
    assert tier.usage().chunk_bytes == 4 * 60_000 == tier.used_bytes and tier.usage().evictions == 2
    assert tier.shed(10 * MiB) == 3 * 60_000  # everything but the pinned chunk
    assert tier.usage().entries == 1 and tier.shed(1) == 0
    assert tier.check() == []
    tier.close()


def test_lazy_arena_is_resident_only_where_chunks_are() -> None:
    n = 64
    tier = CpuTier(CpuTierConfig(capacity_bytes=n * SLOT, slot_bytes=SLOT, policy="lru", pin_memory="never"),
                   lazy=True)
    assert not tier.pinned and arena_rss(tier) == 0  # not pre-touched
    assert all(tier.put([Entry(_key(i), _chunk(i)) for i in range(n)]))
    page_rounded = -(-60_000 // mmap.PAGESIZE) * mmap.PAGESIZE
    assert arena_rss(tier) == n * page_rounded  # only the pages the chunks cover
    assert tier.shed(n // 2 * 60_000) == n // 2 * 60_000
    assert arena_rss(tier) == n // 2 * page_rounded  # the shed slots' pages went back
    assert tier.delete([_key(i) for i in range(n // 2, n // 2 + 8)]) == 8
    assert arena_rss(tier) == (n // 2 - 8) * page_rounded  # so did the deleted ones'
    # Freed slots are reused and hold exactly what was written (zero-filled pages underneath).
    assert all(tier.put([Entry(_key(1000 + i), _chunk(i, 1000)) for i in range(8)]))
    assert tier.get([_key(1000 + i) for i in range(8)]) == [_chunk(i, 1000) for i in range(8)]
    assert tier.get([_key(i) for i in range(n // 2 + 8, n)]) == [_chunk(i) for i in range(n // 2 + 8, n)]
    assert tier.check() == []
    tier.close()


def test_shed_for_reuse_keeps_one_sheds_pages_for_the_put_that_follows() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=16 * SLOT, slot_bytes=SLOT, policy="lru", pin_memory="never"),
                   lazy=True)
    page_rounded = -(-60_000 // mmap.PAGESIZE) * mmap.PAGESIZE
    assert all(tier.put([Entry(_key(i), _chunk(i)) for i in range(8)]))
    assert tier.shed(3 * 60_000, reuse=True) == 3 * 60_000  # the putter makes room for itself
    assert arena_rss(tier) == 8 * page_rounded and tier.check() == []  # pages kept for the put
    assert all(tier.put([Entry(_key(100 + i), _chunk(100 + i)) for i in range(2)]))
    assert arena_rss(tier) == 8 * page_rounded  # refilled without fresh pages
    assert tier.get([_key(100), _key(101)]) == [_chunk(100), _chunk(101)]
    # One kept slot was not refilled: the next shed (any) hands its pages back first.
    assert tier.shed(60_000) == 60_000
    assert arena_rss(tier) == 6 * page_rounded and tier.usage().entries == 6
    assert tier.check() == []
    tier.close()


def test_a_leased_slot_keeps_its_bytes_and_pages_through_shed() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=4 * SLOT, slot_bytes=SLOT, policy="lru", pin_memory="never"),
                   lazy=True)
    assert all(tier.put([Entry(_key(i), _chunk(i)) for i in range(4)]))
    with tier.leased(_key(0)) as view:
        assert isinstance(view, memoryview)
        assert tier.shed(4 * 60_000) == 4 * 60_000
        assert tier.usage().entries == 0
        for i in range(10, 13):  # churn the free slots: the retired one is never handed out
            assert tier.put([Entry(_key(i), _chunk(i))]) == [True]
        assert bytes(view) == _chunk(0)  # not zeroed, not overwritten
        held = arena_rss(tier)
    page_rounded = -(-60_000 // mmap.PAGESIZE) * mmap.PAGESIZE
    assert held == 4 * page_rounded and arena_rss(tier) == 3 * page_rounded  # freed on leave
    assert tier.check() == []
    tier.close()


def _anon_huge_bytes(addr: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_lazy_arena_of_huge_page_slots_is_on_huge_pages() -> None:
    slot = 2 * HUGE_PAGE  # the server's default slot size
    tier = CpuTier(CpuTierConfig(capacity_bytes=4 * slot, slot_bytes=slot, pin_memory="never", huge_pages=True),
                   lazy=True)
    base = np.frombuffer(tier._arena, dtype=np.uint8).ctypes.data
    assert tier._owner.huge and base % HUGE_PAGE == 0 and arena_rss(tier) == 0
    assert tier.put([Entry(_key(i), _chunk(i, slot)) for i in range(2)]) == [True, True]
    assert arena_rss(tier) == 2 * slot
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if thp.exists() and "[never]" not in thp.read_text():  # the kernel may hand out huge pages
        assert _anon_huge_bytes(base) >= HUGE_PAGE  # (all 4 of them unless memory is fragmented)
    assert tier.delete([_key(0)]) == 1
    assert arena_rss(tier) == slot  # the freed slot's pages went back whole
    assert tier.get([_key(1)]) == [_chunk(1, slot)] and tier.check() == []
    tier.close()


def test_huge_pages_only_where_asked_and_slots_are_whole_huge_pages() -> None:
    # A 2 MiB page would keep a whole huge page resident for a 60 KB chunk.
    for slot, asked, huge in ((SLOT, True, False), (2 * HUGE_PAGE, False, False), (2 * HUGE_PAGE, True, True)):
        tier = CpuTier(CpuTierConfig(capacity_bytes=4 * slot, slot_bytes=slot, pin_memory="never",
                                     huge_pages=asked), lazy=True)
        assert tier._owner.huge is huge, (slot, asked)
        tier.close()
    pretouched = CpuTier(CpuTierConfig(capacity_bytes=4 * HUGE_PAGE, slot_bytes=HUGE_PAGE, pin_memory="never",
                                       huge_pages=True))
    assert not pretouched._owner.huge  # a shared (shmem) mapping, pre-touched: ignored
    pretouched.close()


def test_huge_pages_asked_with_slots_of_no_huge_page_multiple_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="kvtier.tiers.cpu")
    slot = HUGE_PAGE + 4096  # a 2 MiB chunk and its header: the case a user meets
    tier = CpuTier(CpuTierConfig(capacity_bytes=4 * slot, slot_bytes=slot, pin_memory="never", huge_pages=True),
                   lazy=True)
    tier.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"cpu tier cpu: huge_pages ignored: slot_bytes {slot} is not a multiple of 2 MiB ({2 * HUGE_PAGE} would be)"]


def test_default_arena_stays_pre_touched() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=16 * SLOT, slot_bytes=SLOT, pin_memory="never"))
    assert arena_rss(tier) == 16 * SLOT  # engines keep the fault-free hot path
    assert all(tier.put([Entry(_key(i), _chunk(i)) for i in range(4)]))
    assert tier.shed(60_000) == 60_000 and arena_rss(tier) == 16 * SLOT  # pages kept
    tier.close()


def test_lazy_arena_refuses_pinning() -> None:
    with pytest.raises(ValueError, match="pin_memory"):
        CpuTier(CpuTierConfig(capacity_bytes=4 * SLOT, slot_bytes=SLOT, pin_memory="always"), lazy=True)

"""A full CpuTier's spare slots (kvtier.tiers.cpu, "Spare slots"): a put in flight may hold a
slot beyond the capacity, and the eviction it needs happens only when it commits, so a
refused (aborted) chunk evicts nothing, the tier never holds more than its capacity of
chunks, and the victim is the policy's. Checked against the tier's own ``check()``.
"""

from __future__ import annotations

import random
import threading

from kvtier.config import CpuTierConfig
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.cpu import CpuTier

SLOT = 64 << 10
SLOTS = 8


def tier(spares: int, lazy: bool = True) -> CpuTier:
    return CpuTier(CpuTierConfig(capacity_bytes=SLOTS * SLOT, slot_bytes=SLOT, pin_memory="never", policy="lru"),
                   lazy=lazy, spare_slots=spares)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def value(i: int, n: int = SLOT) -> bytes:
    return random.Random(i).randbytes(n)


def fill(t: CpuTier) -> None:
    assert t.put([Entry(key(i), value(i)) for i in range(SLOTS)]) == [True] * SLOTS
    assert t.full and not t.check()


def held(t: CpuTier) -> list[int]:
    """The keys held (probed: a probe does not touch the policy's order)."""
    return [i for i in range(100) if t.probe([key(i)]).hits]


def reserve_and_write(t: CpuTier, i: int):  # type: ignore[no-untyped-def]
    res = t.reserve(SLOT)
    assert res is not None
    res.view[:] = value(i)
    return res


def test_an_aborted_spare_reservation_evicts_nothing() -> None:
    t = tier(spares=2)
    fill(t)
    res = reserve_and_write(t, 50)
    assert res.slot >= SLOTS  # the spare, beyond the capacity
    t.abort(res)
    assert held(t) == list(range(SLOTS)) and not t.check()


def test_a_commit_evicts_the_policys_victim_first() -> None:
    t = tier(spares=2)
    fill(t)
    evicted: list[bytes] = []
    t.evict_listener = lambda k, v: evicted.append(k)
    t.get([key(0)])  # LRU: key 1 is now the oldest
    res = reserve_and_write(t, 50)
    assert held(t) == list(range(SLOTS))  # reserving took nothing
    assert t.commit(res, key(50))
    assert evicted == [key(1)]
    assert held(t) == [0, *range(2, SLOTS), 50]
    assert t.get([key(50)]) == [value(50)]
    assert t.usage().entries == SLOTS and not t.check()


def test_overwriting_a_held_key_through_a_spare_evicts_nothing() -> None:
    t = tier(spares=1)
    fill(t)
    res = reserve_and_write(t, 99)
    assert t.commit(res, key(3))
    assert held(t) == list(range(SLOTS)) and t.get([key(3)]) == [value(99)] and not t.check()


def test_spares_run_out_and_puts_still_evict() -> None:
    t = tier(spares=2)
    fill(t)
    a, b = reserve_and_write(t, 60), reserve_and_write(t, 61)
    assert t.reserve(SLOT) is None  # both spares in flight
    assert t.put([Entry(key(62), value(62))]) == [True]  # evicts to make its own slot
    assert t.commit(a, key(60)) and t.commit(b, key(61))
    assert t.usage().entries == SLOTS and {60, 61, 62} <= set(held(t)) and not t.check()


def test_without_spares_a_full_tier_reserves_nothing() -> None:
    t = tier(spares=0, lazy=False)
    fill(t)
    assert t.reserve(SLOT) is None and t.arena_bytes == t.capacity_bytes


def test_threads_reserving_committing_and_reading_keep_every_byte() -> None:
    """Four writers through spares and a reader, on a full tier: every chunk read is the
    bytes its key was last given, the tier never holds more than its capacity."""
    t = tier(spares=3)
    fill(t)
    errors: list[str] = []

    def writer(w: int) -> None:
        rng = random.Random(w)
        for n in range(200):
            i = rng.randrange(40)
            res = t.reserve(SLOT)
            if res is None:
                ok = t.put([Entry(key(i), value(i))])[0]
            else:
                res.view[:] = value(i)
                ok = t.abort(res) is None if n % 5 == 0 else t.commit(res, key(i))
            if not ok:
                errors.append(f"writer {w}: put of {i} refused")
            if t.usage().entries > SLOTS:
                errors.append(f"{t.usage().entries} chunks held")

    def reader() -> None:
        for n in range(2000):
            i = n % 40
            got = t.get([key(i)])[0]
            if not isinstance(got, Miss) and got != value(i):
                errors.append(f"key {i} read wrong bytes")

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)] + [threading.Thread(target=reader)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]
    assert t.usage().entries == SLOTS and not t.check()

"""kvtier-server's warm-ahead (kvtier.server.warm_ahead): free RAM slots faulted in before the
puts that take them, within the reserve and the RAM budget, never changing a stored byte.

Residency is read from the kernel (``mincore`` on the arena), not from the tier's own
bookkeeping, so a slot that is listed as warm but was never faulted in (or one given back that
stayed resident) fails here.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, GrpcTierConfig
from kvtier.server.pool import SharedPool
from kvtier.server.warm_ahead import WarmAhead
from kvtier.tiers.arena_pages import PopulateUnsupported, populate_pages
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import make_chunk, make_keys, start_server

SLOT = 256 << 10
PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def resident_pages(tier: CpuTier, slot: int) -> int:
    """How many of ``slot``'s pages the kernel holds in RAM (mincore)."""
    n = tier.slot_bytes // PAGE
    vec = (ctypes.c_ubyte * n)()
    assert _libc.mincore(tier._base + slot * tier.slot_bytes, tier.slot_bytes, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def lazy_tier(slots: int, name: str = "cpu") -> CpuTier:
    return CpuTier(CpuTierConfig(capacity_bytes=slots * SLOT, slot_bytes=SLOT, pin_memory="never"),
                   name=name, lazy=True)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def chunk(i: int, seed: int = 0) -> bytes:
    return random.Random(i * 1000 + seed).randbytes(SLOT - (i % 7) * 1000)


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_populate_keeps_bytes_already_there() -> None:
    """The primitive's promise that makes warm-ahead safe beside a put writing the slot."""
    m = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(m)
    view[PAGE: PAGE + 5] = b"hello"  # one page present with data, three absent
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    populate_pages(addr, 4 * PAGE)
    assert bytes(view[PAGE: PAGE + 5]) == b"hello" and bytes(view[:PAGE]) == bytes(PAGE)
    with pytest.raises(PopulateUnsupported):
        populate_pages(addr + 1, PAGE)  # EINVAL (misaligned) is how an old kernel answers too
    view.release()
    m.close()


def test_fills_the_reserve_within_the_budget_and_puts_take_warm_slots() -> None:
    tier = lazy_tier(16)
    pool = SharedPool(16 * SLOT, {"t": tier}, {"t": 16 * SLOT})
    wa = WarmAhead([tier], pool, reserve_bytes=4 * SLOT)
    try:
        wait_for(lambda: tier.warm_bytes == 4 * SLOT, "4 warm slots")
        time.sleep(0.05)
        assert tier.warm_bytes == 4 * SLOT  # never past the reserve
        warm = set(tier._warm)
        assert all(resident_pages(tier, s) == SLOT // PAGE for s in warm)
        assert all(resident_pages(tier, s) == 0 for s in range(16) if s not in warm)
        for i in range(6):  # each put takes a warm slot; below half the reserve the thread refills
            warm = set(tier._warm)
            assert tier.put([Entry(key(i), chunk(i))]) == [True]
            assert tier._map[key(i)][0] in warm
            if i in (2, 5):
                wait_for(lambda: tier.warm_bytes == 4 * SLOT, "the reserve refilled")
        assert wa.warmed_bytes == 10 * SLOT
        assert tier.get([key(i) for i in range(6)]) == [chunk(i) for i in range(6)]
        assert tier.check() == []
        # Overwrites keep the reserve warm by themselves (the old slot stays warm): no wake-up
        # per put, which would cost the put path a context switch each.
        woken = wa.wakeups
        for _ in range(50):
            assert tier.put([Entry(key(0), chunk(0))]) == [True]
        time.sleep(0.05)
        assert wa.wakeups == woken and tier.warm_bytes >= 4 * SLOT
    finally:
        wa.close()
        tier.close()


def test_a_full_budget_does_not_wake_the_thread_per_put() -> None:
    """A full cache's puts evict and reuse their victims' pages; the thread stays asleep
    (it looks for room once per POLL_S), and comes back when a delete makes room."""
    tier = lazy_tier(8)
    pool = SharedPool(4 * SLOT, {"t": tier}, {"t": 4 * SLOT})
    wa = WarmAhead([tier], pool, reserve_bytes=2 * SLOT)
    try:
        for i in range(40):
            pool.make_room("t", SLOT)
            assert tier.put([Entry(key(i), chunk(i))]) == [True]
        time.sleep(0.05)
        woken = wa.wakeups
        for i in range(40, 80):
            pool.make_room("t", SLOT)
            assert tier.put([Entry(key(i), chunk(i))]) == [True]
        time.sleep(0.05)
        assert wa.wakeups == woken
        assert tier.delete([key(i) for i in range(76, 80)]) == 4  # room for two warm slots again
        wait_for(lambda: wa.warm_bytes() == 2 * SLOT, "the poll to find the room", timeout=5)
        assert tier.check() == []
    finally:
        wa.close()
        tier.close()


def test_never_warms_past_the_budget_and_gives_slots_back_when_chunks_grow() -> None:
    """Two tenants in an 8-slot budget with a 6-slot reserve: warm slots share the room with
    the chunks held, and when one tenant's chunks grow into it the other's warm slots go back
    to the OS (mincore: no longer resident)."""
    a, b = lazy_tier(8, "a"), lazy_tier(8, "b")
    pool = SharedPool(8 * SLOT, {"a": a, "b": b}, {"a": 4 * SLOT, "b": 4 * SLOT})
    wa = WarmAhead([a, b], pool, reserve_bytes=6 * SLOT)
    try:
        wait_for(lambda: wa.warm_bytes() == 6 * SLOT, "the reserve split between the tenants")
        assert a.warm_bytes == b.warm_bytes == 3 * SLOT  # one slot each in turn
        a_warm = list(a._warm)
        for i in range(7):  # b's chunks: room left 1 slot
            pool.make_room("b", SLOT)
            assert b.put([Entry(key(i), chunk(i))]) == [True]
        wait_for(lambda: wa.warm_bytes() <= pool.room(), "warm slots within the room left")
        assert SLOT <= pool.room() < 2 * SLOT and wa.warm_bytes() == SLOT
        given_back = [s for s in a_warm if s not in a._warm]
        assert given_back and all(resident_pages(a, s) == 0 for s in given_back)
        assert b.get([key(i) for i in range(7)]) == [chunk(i) for i in range(7)]
        assert a.check() == [] and b.check() == []
    finally:
        wa.close()
        a.close()
        b.close()


def test_warming_beside_puts_deletes_and_reads_never_changes_a_stored_byte() -> None:
    """A thread warms and gives back slots as fast as it can while puts, overwrites, deletes
    and reads run: every read returns exactly what was last put, and the slot bookkeeping
    stays whole."""
    tier = lazy_tier(12)
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        try:
            while not stop.is_set():
                tier.warm_ahead()
                if random.random() < 0.3:
                    tier.cool_one()
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)

    thread = threading.Thread(target=churn)
    thread.start()
    rng = random.Random(7)
    held: dict[int, int] = {}  # key index -> seed of the bytes put
    try:
        for step in range(1500):
            i = rng.randrange(20)
            op = rng.random()
            if op < 0.5:
                ok = tier.put([Entry(key(i), chunk(i, step))])
                if ok == [True]:
                    held[i] = step
            elif op < 0.65:
                tier.delete([key(i)])
                held.pop(i, None)
            else:
                got = tier.get([key(i)])[0]
                if isinstance(got, Miss):
                    held.pop(i, None)  # evicted (12 slots, 20 keys)
                else:
                    assert i in held and got == chunk(i, held[i]), f"key {i} at step {step}"
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert tier.check() == []
    for i, seed in held.items():
        got = tier.get([key(i)])[0]
        assert isinstance(got, Miss) or got == chunk(i, seed)
    tier.close()


def test_a_tenant_at_its_cap_does_not_wake_the_thread_per_put() -> None:
    """A tenant whose tier is full at its own cap, in a budget with room: its puts evict its
    own chunks and reuse their pages, and with no cold slot left there is nothing to warm,
    so the thread stays asleep (a wake-up per put costs the put path a context switch)."""
    tier = lazy_tier(4)
    pool = SharedPool(16 * SLOT, {"t": tier}, {"t": 16 * SLOT})
    wa = WarmAhead([tier], pool, reserve_bytes=4 * SLOT)
    try:
        for i in range(8):
            assert tier.put([Entry(key(i), chunk(i))]) == [True]
        time.sleep(0.05)
        woken = wa.wakeups
        for i in range(8, 48):
            assert tier.put([Entry(key(i), chunk(i))]) == [True]
        time.sleep(0.05)
        assert wa.wakeups == woken
        assert tier.get([key(47)]) == [chunk(47)] and tier.check() == []
    finally:
        wa.close()
        tier.close()


class _OldKernelTier(CpuTier):
    """A tier on a kernel without MADV_POPULATE_WRITE (a fake: the one refusal it injects)."""

    def warm_ahead(self) -> int:
        raise PopulateUnsupported(22, "madvise(MADV_POPULATE_WRITE) refused (errno 22: EINVAL)")


def test_a_kernel_that_cannot_populate_turns_warm_ahead_off(caplog: pytest.LogCaptureFixture) -> None:
    tier = _OldKernelTier(CpuTierConfig(capacity_bytes=4 * SLOT, slot_bytes=SLOT, pin_memory="never"), lazy=True)
    pool = SharedPool(4 * SLOT, {"t": tier}, {"t": 4 * SLOT})
    with caplog.at_level(logging.INFO, logger="kvtier.server.warm_ahead"):
        wa = WarmAhead([tier], pool, reserve_bytes=2 * SLOT)
        wait_for(lambda: not wa._thread.is_alive(), "the thread to stop")
    assert "warm-ahead off" in caplog.text
    assert tier.put([Entry(key(1), chunk(1))]) == [True]  # puts do without it
    assert tier.get([key(1)]) == [chunk(1)] and tier.warm_bytes == 0
    wa.close()
    tier.close()


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, (name, text)
    return values[0]


def test_server_warms_ahead_and_shows_it(tmp_path: Path) -> None:
    """A real kvtier-server: the reserve is faulted in at start, PUTs take from it, /metrics
    shows both; with ``cpu.warm_ahead_bytes=0`` there is no thread and no series."""
    s = start_server(tmp_path / "on", "--set", "cpu.warm_ahead_bytes=8MiB")
    client = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,)))
    try:
        wait_for(lambda: _metric(s.metrics(), "kvtier_server_ram_warm_bytes") == 8 << 20, "8 MiB warm")
        keys = make_keys(12, seed=3)
        chunks = [make_chunk(k, 600_000, seed=i) for i, k in enumerate(keys)]
        assert client.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 12
        # (>=: a put run gives back the slots it reserved and did not use, warm, on top)
        wait_for(lambda: _metric(s.metrics(), "kvtier_server_ram_warm_bytes") >= 8 << 20, "the reserve refilled")
        # the reserve filled at start and again after the puts drew on it
        assert _metric(s.metrics(), "kvtier_server_ram_warmed_bytes_total") > 8 << 20
        assert client.get(keys) == chunks
    finally:
        client.close()
        assert s.stop() == 0, s.log
    off = start_server(tmp_path / "off", "--set", "cpu.warm_ahead_bytes=0")
    try:
        assert "kvtier_server_ram_warm" not in off.metrics()
    finally:
        assert off.stop() == 0, off.log


def test_a_full_tiers_spare_slots_stay_warm() -> None:
    """A tier at its capacity puts through its spare slots (kvtier.tiers.cpu, "Spare slots"),
    each commit keeping its victim's slot warm for the next put. With the budget full the
    thread gives warm slots back only beyond the tiers' spares: the spare's pages stay
    resident (mincore), so puts into a full tier do not fault. Without the allowance it
    gives them back at the next wake-up."""
    t = CpuTier(CpuTierConfig(capacity_bytes=16 * SLOT, slot_bytes=SLOT, pin_memory="never", policy="lru"),
                lazy=True, spare_slots=2)
    pool = SharedPool(16 * SLOT, {"a": t}, {"a": 16 * SLOT})
    wa = WarmAhead([t], pool, reserve_bytes=4 * SLOT)
    try:
        for i in range(16):
            assert t.put([Entry(key(i), chunk(i))]) == [True]
        for i in range(16, 40):
            data = chunk(i)
            res = t.reserve(len(data))
            assert res is not None
            res.view[:] = data
            assert t.commit(res, key(i))
        assert pool.room() < SLOT <= t.warm_bytes  # no room in the budget for a warm slot
        warm = list(t._warm)
        wa._fill([])  # what the thread does when woken (a cold take wakes it)
        assert t._warm == warm and all(resident_pages(t, s) == t.slot_bytes // PAGE for s in warm)
        assert t.get([key(i) for i in range(24, 40)]) == [chunk(i) for i in range(24, 40)]
        assert t.check() == []
    finally:
        wa.close()
        t.close()

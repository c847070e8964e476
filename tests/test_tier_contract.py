"""The contract suite (tests/contract.py) over the local tiers, plus cpu-arena specifics and
the fault-injecting fake's own behaviour."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.chunk import decode_chunk
from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.errors import ChunkError
from kvtier.tiers import cpu as cpu_module
from kvtier.tiers.base import ABSENT, EVICTED, NODE_DOWN, TIMEOUT, Entry, Miss, Tier
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from tests.contract import CHUNK, NAMESPACE, TierContract, chunk_for, key_of
from tests.fakes import FaultyTier

SLOT = 4096  # holds every default test chunk (2176-3200 bytes)


def cpu(capacity: int, slot: int = SLOT) -> CpuTier:
    """A cpu tier with LRU named explicitly: the arena tests say which chunk goes first."""
    return CpuTier(CpuTierConfig(capacity_bytes=capacity, slot_bytes=slot, policy="lru"))


def _factory(build: Callable[[int], Any]) -> Iterator[Callable[[int], Any]]:
    made: list[Any] = []

    def make(capacity_bytes: int) -> Any:
        tier = build(capacity_bytes)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


class TestMemoryTier(TierContract):
    @pytest.fixture
    def make_tier(self) -> Iterator[Callable[[int], Any]]:
        yield from _factory(lambda cap: MemoryTier(cap))


class TestFaultyTierWithoutFaults(TierContract):
    @pytest.fixture
    def make_tier(self) -> Iterator[Callable[[int], Any]]:
        yield from _factory(lambda cap: FaultyTier(cap))


class TestCpuTier(TierContract):
    @pytest.fixture
    def make_tier(self) -> Iterator[Callable[[int], Any]]:
        # The configured default policy, whatever it is: the contract assumes no order.
        yield from _factory(lambda cap: CpuTier(CpuTierConfig(capacity_bytes=cap, slot_bytes=SLOT)))


class TestLazyCpuTier(TierContract):
    """The server's lazily backed arena (pages returned to the OS as slots are freed)."""

    @pytest.fixture
    def make_tier(self) -> Iterator[Callable[[int], Any]]:
        yield from _factory(lambda cap: CpuTier(
            CpuTierConfig(capacity_bytes=cap, slot_bytes=SLOT, pin_memory="never"), lazy=True))


class TestDiskTier(TierContract):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Iterator[Callable[[int], Any]]:
        counter = iter(range(1000))
        yield from _factory(lambda cap: DiskTier(DiskTierConfig(
            path=str(tmp_path / f"disk{next(counter)}"), capacity_bytes=cap)))


class TestDiskTierBuffered(TierContract):
    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Iterator[Callable[[int], Any]]:
        counter = iter(range(1000))
        yield from _factory(lambda cap: DiskTier(DiskTierConfig(
            path=str(tmp_path / f"disk{next(counter)}"), capacity_bytes=cap, o_direct=False)))


# --- cpu arena specifics ----------------------------------------------------------------------
def test_cpu_tier_is_a_tier() -> None:
    tier = cpu(1 << 20)
    assert isinstance(tier, Tier)
    torch = sys.modules.get("torch")  # "auto" pins only through an already-loaded torch
    assert tier.slots == 256 and tier.pinned == bool(torch is not None and torch.cuda.is_available())
    tier.close()


@pytest.mark.parametrize("pin", ["always", "never"])
def test_cpu_arena_without_cuda_falls_back_to_pageable(pin: str) -> None:
    torch = pytest.importorskip("torch") if pin == "always" else None
    if torch is not None and torch.cuda.is_available():
        pytest.skip("CUDA present: the arena is pinned")
    tier = CpuTier(CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=SLOT, pin_memory=pin))
    assert not tier.pinned
    key = key_of("pin")
    assert tier.put([Entry(key, chunk_for(key))]) == [True] and tier.get([key]) == [chunk_for(key)]
    tier.close()


def test_cpu_chunk_larger_than_slot_is_refused() -> None:
    tier = cpu(1 << 20)
    key = key_of("big")
    big = chunk_for(key, tokens=64)
    assert SLOT < len(big) < tier.capacity_bytes
    assert tier.put([Entry(key, big)]) == [False]
    assert tier.get([key]) == [Miss(ABSENT)]
    assert tier.check() == []


def test_cpu_capacity_is_whole_slots() -> None:
    with pytest.raises(ValueError):
        cpu(SLOT - 1)
    tier = cpu(3 * SLOT + 100)
    assert tier.slots == 3 and tier.usage().capacity_bytes == 3 * SLOT
    keys = [key_of(f"s{i}") for i in range(4)]
    assert tier.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * 4
    assert tier.usage().entries == 3
    assert tier.get(keys[:1]) == [Miss(EVICTED)]
    assert tier.check() == []


def test_cpu_pins_and_evict_listener() -> None:
    tier = cpu(2 * SLOT)
    seen: list[tuple[bytes, bytes]] = []
    tier.evict_listener = lambda k, v: seen.append((k, v))
    a, b, c = key_of("a"), key_of("b"), key_of("c")
    tier.put([Entry(a, chunk_for(a)), Entry(b, chunk_for(b))])
    tier.pin([a])
    assert tier.put([Entry(c, chunk_for(c))]) == [True]
    assert seen == [(b, chunk_for(b))]  # a is pinned, so b went, bytes intact
    tier.pin([c])
    d = key_of("d")
    assert tier.put([Entry(d, chunk_for(d))]) == [False]  # everything pinned
    tier.unpin([a])
    assert tier.put([Entry(d, chunk_for(d))]) == [True]
    assert tier.get([a, c, d]) == [Miss(EVICTED), chunk_for(c), chunk_for(d)]
    assert tier.check() == []


@pytest.mark.parametrize("kind", ["memory", "disk", "disk-buffered"])
def test_put_that_cannot_fit_beside_pins_evicts_nothing(kind: str, tmp_path: Path) -> None:
    """A chunk larger than capacity minus the pinned bytes is refused before any eviction:
    the old code threw every unpinned chunk away and then refused anyway."""
    unit = 4096 if kind == "disk" else CHUNK  # O_DIRECT files take whole 4 KiB blocks
    cap = 7 * unit
    tier: Any = (MemoryTier(cap) if kind == "memory" else DiskTier(DiskTierConfig(
        path=str(tmp_path / "d"), capacity_bytes=cap, o_direct=kind == "disk")))
    keys = [key_of(f"fit{i}") for i in range(6)]
    assert tier.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * 6
    tier.pin(keys[:4])
    big_key = key_of("fit-big")
    big = chunk_for(big_key, tokens=112)  # more than 3 units (all but the pins), less than 7
    assert 3 * unit < len(big) < cap  # the 4 pinned chunks take 4 units
    assert tier.put([Entry(big_key, big)]) == [False]
    assert tier.get(keys) == [chunk_for(k) for k in keys]  # nothing was evicted
    assert tier.usage().evictions == 0
    tier.unpin(keys[:4])  # now it fits once unpinned chunks go
    assert tier.put([Entry(big_key, big)]) == [True]
    assert tier.get([big_key]) == [big] and tier.usage().evictions > 0
    assert tier.check() == []
    tier.close()


def test_cpu_slot_being_read_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader's slot survives eviction until the reader leaves (reader count + retire)."""
    tier = cpu(SLOT)
    a, b = key_of("ra"), key_of("rb")
    tier.put([Entry(a, chunk_for(a))])
    started, release = threading.Event(), threading.Event()
    copy = cpu_module.copy_into

    def slow_copy(dst: memoryview, src: memoryview, *, streaming: bool = False) -> None:
        """The read's copy out of the slot, held open until released."""
        started.set()
        release.wait(10)
        copy(dst, src, streaming=streaming)

    monkeypatch.setattr(cpu_module, "copy_into", slow_copy)
    out = bytearray(CHUNK)
    reader = threading.Thread(target=lambda: tier.get_into([a], [memoryview(out)]))
    reader.start()
    assert started.wait(10)
    assert tier.put([Entry(b, chunk_for(b))]) == [False]  # the only slot is retired, not free
    assert tier.check() == []
    release.set()
    reader.join(10)
    assert bytes(out) == chunk_for(a)
    assert tier.put([Entry(b, chunk_for(b))]) == [True]
    assert tier.get([a, b]) == [Miss(EVICTED), chunk_for(b)]
    assert tier.check() == []


# --- the fake's faults ------------------------------------------------------------------------
def test_faulty_tier_scripted_faults() -> None:
    tier = FaultyTier(1 << 20)
    keys = [key_of(f"f{i}") for i in range(4)]
    tier.put([Entry(k, chunk_for(k)) for k in keys])
    tier.fail_gets(keys[1], reason=TIMEOUT, times=1)
    assert tier.probe(keys).hits == 1 and tier.probe(keys).hits == 4  # only once
    tier.fail_gets(keys[2], reason="node_down")
    assert tier.get(keys) == [chunk_for(keys[0]), chunk_for(keys[1]), Miss("node_down"), chunk_for(keys[3])]
    tier.corrupt(keys[0], times=1)
    bad = tier.get(keys[:1])[0]
    assert isinstance(bad, bytes) and bad != chunk_for(keys[0])
    with pytest.raises(ChunkError):
        decode_chunk(bad, namespace=NAMESPACE, verify=True)
    out = memoryview(bytearray(CHUNK))
    assert tier.get_into(keys[2:3], [out]) == [Miss("node_down")]
    tier.fail_puts(keys[3], times=1)
    assert tier.put([Entry(keys[3], chunk_for(keys[3])), Entry(keys[0], chunk_for(keys[0]))]) == [False, True]
    tier.down = True
    assert tier.get(keys[:1]) == [Miss(NODE_DOWN)] and tier.put([Entry(keys[0], chunk_for(keys[0]))]) == [False]
    tier.heal()
    assert tier.get(keys) == [chunk_for(k) for k in keys]
    assert tier.injected["miss:timeout"] == 1 and tier.injected["corrupt"] == 1
    assert tier.check() == []


def test_faulty_tier_probabilistic_faults_are_seeded() -> None:
    def run() -> list[object]:
        tier = FaultyTier(1 << 20, seed=5, miss_rate=0.3, put_fail_rate=0.2)
        keys = [key_of(f"r{i}") for i in range(50)]
        puts = tier.put([Entry(k, chunk_for(k)) for k in keys])
        return [*puts, *tier.get(keys)]

    first = run()
    assert first == run()
    assert False in first and Miss(TIMEOUT) in first and any(isinstance(v, bytes) for v in first)

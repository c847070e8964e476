"""The store's write-behind (kvtier.writebehind) against what an audit found it did wrong:
``write_through_selective`` stopped at tier 1, its hit counts grew forever, a delete was undone
by writes queued before it, ``close()`` could deadlock with an eviction's write-back, a disk
tier read every victim's file under its lock for a store that never used the bytes, and a
memory tier counted a non-byte memoryview's elements as bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kvtier.writebehind
from kvtier.config import DiskTierConfig, StoreConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from tests.contract import chunk_for, key_of
from tests.test_store import BlockingTier, _entries


def test_selective_writes_a_due_chunk_into_every_tier_below() -> None:
    a, b, c = MemoryTier(name="a"), MemoryTier(name="b"), MemoryTier(name="c")
    keys, entries = _entries(3)
    with TieredStore([a, b, c], StoreConfig(write_policy="write_through_selective", selective_min_hits=2)) as store:
        store.store(entries)
        store.load(keys)
        store.load(keys)
        store.flush(5)
        assert (b.contains(keys), c.contains(keys)) == (3, 3)  # c was never written before


def test_selective_hit_counts_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvtier.writebehind, "HITS_REMEMBERED", 50)
    a, b = MemoryTier(name="a"), MemoryTier(name="b")
    with TieredStore([a, b], StoreConfig(write_policy="write_through_selective", selective_min_hits=2)) as store:
        keys = [key_of(f"k{i}") for i in range(500)]
        store.store([Entry(k, b"x" * 10) for k in keys])
        for k in keys:
            store.load([k])
        assert len(store._load_counts) == 50  # the least recently loaded went
        store.load(keys[-1:])  # a remembered key still becomes due on its second load
        store.flush(5)
        assert b.contains(keys[-1:]) == 1 and b.usage().entries == 1


def test_a_delete_cancels_the_writes_queued_before_it() -> None:
    a, b = MemoryTier(name="a"), BlockingTier("b")
    keys, entries = _entries(4)
    with TieredStore([a, b], StoreConfig(write_policy="write_through")) as store:
        store.store(entries[:1])  # the writer holds this one in b's put
        store.store(entries[1:3])
        assert store.delete(keys[:3]) == 3  # a's copies; b's are in the queue or being written
        store.store(entries[3:])  # stored after the delete: written
        b.release.set()
        assert store.flush(5)
        # entry 0 was inside b's put when the delete ran: taken back out after it landed
        assert [b.contains([k]) for k in keys] == [0, 0, 0, 1]
        # Once the queue drained, the marks are gone: later writes of those keys are written.
        store.store(entries[1:2])
        assert store.flush(5) and b.contains(keys[1:2]) == 1
        assert len(store._behind._deleted) == 0 and not store._behind._marks


def test_close_returns_while_an_eviction_write_back_races_it() -> None:
    """close() used to block in a full queue's put holding the lock the writer needed to
    enqueue an eviction's write-back: neither moved. The writer is paused just before that
    enqueue, close() runs into the full queue, then the writer goes on."""
    a = MemoryTier(capacity_bytes=250, name="a")
    b, c = BlockingTier("b"), MemoryTier(name="c")
    keys, entries = _entries(6)
    store = TieredStore([a, b, c], StoreConfig(write_policy="write_back", queue_depth=1))
    at_enqueue, go = threading.Event(), threading.Event()
    real = store._behind.enqueue

    def paused(*args: object) -> None:
        if threading.current_thread().name == "kvtier-store-writer":
            at_enqueue.set()
            go.wait(10)
        real(*args)  # type: ignore[arg-type]

    store._behind.enqueue = paused  # type: ignore[method-assign]
    b.capacity_bytes = 150  # b evicts (write-back into c) on its second chunk

    def taken() -> None:  # the writer took what was queued
        end = time.monotonic() + 10
        while store._behind._queue.qsize() and time.monotonic() < end:
            time.sleep(0.01)

    for e in entries[:3]:
        store.store([e])  # the third evicts entry 0 from a: a job for b
    taken()  # ... which the writer holds in b's put
    store.store(entries[3:4])  # entry 1's job: the queue is full
    b.release.set()  # the writer puts entry 0, then entry 1, which evicts entry 0 from b
    assert at_enqueue.wait(10)  # the writer passed the closed check, about to enqueue into c
    store.store(entries[4:5])  # the queue is full again
    closer = threading.Thread(target=store.close)
    closer.start()
    time.sleep(0.3)  # close() is now in the queue's put
    go.set()
    closer.join(10)
    assert not closer.is_alive(), "close() deadlocked with the writer"


def test_a_store_that_never_writes_back_gets_no_victim_bytes(tmp_path: Path) -> None:
    one = len(chunk_for(key_of("d0")))
    disk = DiskTier(DiskTierConfig(path=str(tmp_path), capacity_bytes=3 * one + 100, o_direct=False))
    reads = []
    real = disk._read

    def counted(key: bytes, out: object, victim: bool = False) -> object:
        reads.append(victim)
        return real(key, out, victim)  # type: ignore[arg-type]

    disk._read = counted  # type: ignore[method-assign]
    with TieredStore([disk], StoreConfig(write_policy="write_through")) as store:
        keys = [key_of(f"d{i}") for i in range(8)]
        for k in keys:
            store.store([Entry(k, chunk_for(k))])
        evicted = store.metrics.registry.get_sample_value("kvtier_evictions_total",
                                                          {"tier": disk.name, "reason": "capacity"})
        assert evicted and evicted >= 4  # evictions still counted (and told to listeners)
        assert True not in reads  # ... without reading any victim's file


def test_memory_tier_counts_bytes_of_a_typed_memoryview() -> None:
    tier = MemoryTier(capacity_bytes=1 << 20, name="m")
    data = memoryview(np.arange(100, dtype=np.float32))
    assert tier.put([Entry(key_of("f"), data)]) == [True]
    assert tier.usage().used_bytes == 400 and tier.check() == []

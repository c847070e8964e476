"""The kvtier-server promotes chunks with the depth and parent their Put gave
(kvtier.server.chunk_links): a disk hit copied into RAM (``TenantStore.get``/``get_into``,
after RAM evicted it or after a restart) and a chunk read back from the lower tier (Redis:
``LoweredStore``'s Get and its lookup-time prefetch). A chunk promoted with no parent is a
root to the node's RAM policy, and prefix-aware policies then evict prefixes before the
chunks extending them.

The check (``drain``): RAM is emptied one eviction at a time; no victim may be the parent of a
chunk RAM still holds. (Before: of the 16 promoted chunks, 12 such victims with every
prefix-aware policy, from disk and from Redis alike; the Redis read-backs also reached the
disk with no lineage record.)
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, DiskTierConfig, RedisTierConfig
from kvtier.server.auth import Tenant
from kvtier.server.chunk_links import disk_link
from kvtier.server.lower import LoweredStore
from kvtier.server.storage import Storage, TenantStore
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.redis import RedisTier
from tests.contract import LEAF_FIRST, chains
from tests.redis_servers import FAST, RedisServer, have_redis

SLOT = 64 << 10
RAM_SLOTS = 16


def storage(path: Path, policy: str, factory: Callable[..., TenantStore] | None = None) -> Storage:
    """One tenant: RAM of 16 slots over a disk that holds everything here."""
    return Storage([Tenant("t")], CpuTierConfig(capacity_bytes=RAM_SLOTS * SLOT, slot_bytes=SLOT, policy=policy),
                   DiskTierConfig(enabled=True, path=str(path), capacity_bytes=64 << 20, policy=policy,
                                  o_direct=False), store_factory=factory)


def drain(ram: CpuTier, parents: dict[bytes, bytes]) -> tuple[int, list[bytes]]:
    """Empty ``ram`` one eviction at a time: (victims, victims that were the parent of a chunk
    RAM still held). ``shed(1)`` evicts one chunk and calls the listener before returning."""
    wrong: list[bytes] = []
    victims = 0

    def evicted(key: bytes, _value: bytes) -> None:
        nonlocal victims
        victims += 1
        if any(parents.get(held) == key for held in ram._map):
            wrong.append(key)

    ram.evict_listener = evicted
    while ram.usage().entries:
        assert ram.shed(1) > 0
    ram.evict_listener = None
    return victims, wrong


def read(store: TenantStore, chain: list[Entry], how: str) -> None:
    keys = [e.key for e in chain]
    if how == "get_into":
        outs = [memoryview(bytearray(SLOT)) for _ in keys]
        got = store.get_into(keys, outs)
        assert [bytes(o[:n]) for o, n in zip(outs, got) if not isinstance(n, Miss)] == [e.data for e in chain]
        return
    if how == "probe":  # a lookup that finds them in Redis prefetches them; the Get waits for it
        assert store.probe(keys).hits == len(keys)
    assert store.get(keys) == [e.data for e in chain]


@pytest.mark.parametrize("why", ["evicted", "restarted"])
@pytest.mark.parametrize("how", ["get", "get_into"])
@pytest.mark.parametrize("policy", LEAF_FIRST)
def test_disk_hits_are_promoted_into_ram_with_their_parents(tmp_path: Path, policy: str, how: str,
                                                           why: str) -> None:
    """Eight 4-chunk prefixes are put (RAM keeps the last four); RAM is emptied (evicted, or
    the server restarts: the disk index is rebuilt, RAM starts empty); the first four are
    read back from disk, so promoted into RAM; RAM then evicts leaves first."""
    stored = chains("c", 8, 4)
    s = storage(tmp_path, policy)
    try:
        store = s.store("t")
        for chain in stored:
            assert store.put(chain) == [True] * 4
        if why == "restarted":
            s.close()
            s = storage(tmp_path, policy)
            store = s.store("t")
            assert store.disk is not None and store.disk.rebuild_stats.files == 32
        assert store.ram is not None
        store.ram.shed(RAM_SLOTS * SLOT)
        assert store.ram.usage().entries == 0
        for chain in stored[:4]:
            read(store, chain, how)
        assert store.ram.usage().entries == 16
        victims, wrong = drain(store.ram, {e.key: e.parent for c in stored for e in c})
        assert (victims, len(wrong)) == (16, 0)
        assert s.check() == []
    finally:
        s.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    if not have_redis():
        pytest.skip("redis-server is not installed")
    server = RedisServer().start()
    yield server
    server.cleanup()


@pytest.mark.parametrize("how", ["get", "probe"])
@pytest.mark.parametrize("policy", LEAF_FIRST)
def test_chunks_read_back_from_redis_keep_the_links_this_node_put(tmp_path: Path, redis_server: RedisServer,
                                                                  policy: str, how: str) -> None:
    """RAM over disk over Redis: four prefixes are put (and written through to Redis), then
    leave the node's tiers (not Redis); a Get (or a lookup's prefetch) reads them back from
    Redis into disk and RAM, each with the depth and parent its Put gave: the disk's lineage
    record holds them, and RAM evicts leaves first."""
    prefix = f"links-{uuid.uuid4().hex[:8]}"

    def factory(tenant: Tenant, ram: CpuTier | None, disk: DiskTier | None) -> TenantStore:
        lower = RedisTier(RedisTierConfig(enabled=True, url=redis_server.url, key_prefix=prefix, **FAST),  # type: ignore[arg-type]
                          name="redis")
        return LoweredStore(tenant, ram, disk, lower=lower, queue_bytes=16 << 20, drain_s=5.0)

    stored = chains("r", 4, 4)
    s = storage(tmp_path, policy, factory)
    try:
        store = s.store("t")
        assert isinstance(store, LoweredStore) and store.ram is not None and store.disk is not None
        for chain in stored:
            assert store.put(chain) == [True] * 4
        deadline = time.monotonic() + 10
        while store.writer.snapshot()["written"] < 16:
            assert time.monotonic() < deadline, store.writer.snapshot()
            time.sleep(0.01)
        keys = [e.key for c in stored for e in c]
        assert all(store.ram.delete([k]) and store.disk.delete([k]) for k in keys)  # Redis keeps them
        assert store.disk.probe(keys[:1]).hits == 0
        for chain in stored:
            read(store, chain, how)
        assert [disk_link(store.disk, e.key) for c in stored for e in c] == \
            [(e.depth, e.parent) for c in stored for e in c]
        victims, wrong = drain(store.ram, {e.key: e.parent for c in stored for e in c})
        assert (victims, len(wrong)) == (16, 0)
    finally:
        s.close()

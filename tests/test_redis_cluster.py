"""The redis tier against a real 3-master Redis Cluster (no replicas, started by a fixture).

Covers: the contract suite, keys spread over all masters, a prefix probe stopping at a down
master, MOVED after a slot moves (labelled, slot map patched, next call hits), SIGKILL of a
master under load (no exception, labelled misses, no call past the timeout, recovery on its
own after the master restarts), and a lazy start before the cluster exists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from kvtier.errors import TierUnavailableError
from kvtier.tiers.base import ABSENT, NODE_DOWN, TIMEOUT, Entry, Miss
from kvtier.tiers.redis import RedisTier
from tests.contract import TierContract, chunk_for, key_of
from tests.redis_servers import (  # noqa: F401 (redis_tiers provides the "tiers" fixture)
    FAST,
    RedisClusterServers,
    RedisServer,
    free_port,
    have_redis,
    make_tls_files,
    redis_tiers,
)

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server/redis-cli not installed")

@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    c = RedisClusterServers().start()
    yield c
    c.cleanup()


CONTRACT_MAXMEMORY = 3 << 20  # per master: ~1.2 MiB of chunks above an empty node's ~1.8 MiB


@pytest.fixture(scope="module")
def contract_cluster() -> Iterator[RedisClusterServers]:
    """The contract's own cluster: every master bounded and evicting like a cache, so the
    contract's capacity and eviction checks run (observed through the tier)."""
    c = RedisClusterServers(args=("--maxmemory", str(CONTRACT_MAXMEMORY),
                                  "--maxmemory-policy", "allkeys-lru")).start()
    yield c
    c.cleanup()


class TestRedisClusterContract(TierContract):
    reports_evicted = False
    exact_usage = False
    exact_eviction = False  # approximate LRU may pick a chunk written this second
    capacity = 3 * CONTRACT_MAXMEMORY  # usage() sums maxmemory over the 3 masters
    overfill = 1  # 9 MiB of chunks against ~3.6 MiB of room: evicts, in half the round trips

    @pytest.fixture
    def make_tier(self, contract_cluster: RedisClusterServers,
                  tiers: Callable[..., RedisTier]) -> Callable[[int], RedisTier]:
        def factory(capacity_bytes: int) -> RedisTier:
            assert capacity_bytes == 3 * CONTRACT_MAXMEMORY
            contract_cluster.flushall()
            # refused before sending: a value one master cannot hold never reaches it
            return tiers(contract_cluster.url, max_value_bytes=CONTRACT_MAXMEMORY // 4)
        return factory


def _owner(cluster: RedisClusterServers, name: bytes, password: str = "") -> RedisServer:
    """The master that holds ``name`` (asked of the servers, not of the tier)."""
    raw = redis.Redis(port=cluster.nodes[0].port, password=password or None)
    slot = int(raw.execute_command("CLUSTER", "KEYSLOT", name))
    for start, end, (_host, port, *_id), *_replicas in raw.execute_command("CLUSTER", "SLOTS"):
        if start <= slot <= end:
            return next(n for n in cluster.nodes if n.port == int(port))
    raise AssertionError(f"slot {slot} not covered")


def test_keys_spread_over_all_masters(cluster: RedisClusterServers,
                                      tiers: Callable[..., RedisTier]) -> None:
    cluster.flushall()
    t = tiers(cluster.url)
    keys = [key_of(f"spread{i}") for i in range(300)]
    assert t.put([Entry(k, chunk_for(k, tokens=1)) for k in keys]) == [True] * 300
    sizes = cluster.dbsizes()
    assert sum(sizes) == 300 and min(sizes) > 50, sizes
    assert t.probe(keys).hits == 300
    assert t.usage().entries == 300
    assert t.delete(keys) == 300 and cluster.dbsizes() == [0, 0, 0]


def test_moved_is_labelled_and_heals(cluster: RedisClusterServers,
                                     tiers: Callable[..., RedisTier]) -> None:
    cluster.flushall()
    t = tiers(cluster.url)
    key = key_of("moved")
    name = t.redis_key(key)
    src = _owner(cluster, name)
    dst = next(n for n in cluster.nodes if n is not src)
    slot = int(src.client().execute_command("CLUSTER", "KEYSLOT", name))
    dst_id = dst.client().execute_command("CLUSTER", "MYID")
    try:
        for node in [dst] + [n for n in cluster.nodes if n is not dst]:  # move the empty slot
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        assert t.put([Entry(key, b"m" * 50)]) == [False]  # the tier's slot map is stale: MOVED
        assert t.failures["moved"] == 1
        assert t.put([Entry(key, b"m" * 50)]) == [True]  # map patched from the MOVED reply
        assert t.get([key]) == [b"m" * 50]
        assert dst.client().get(name) == b"m" * 50
    finally:
        src_id = src.client().execute_command("CLUSTER", "MYID")
        dst.client().delete(name)
        for node in [src] + [n for n in cluster.nodes if n is not src]:
            node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", src_id)
        cluster.wait_ok()


def _load_loop(t: RedisTier, keys: list[bytes], stop: threading.Event,
               log: list[tuple[float, Any]]) -> None:
    i = 0
    while not stop.is_set():
        batch = [keys[(i + j) % len(keys)] for j in range(8)]
        entries = [Entry(k, chunk_for(k)) for k in batch]
        for call in (lambda b=batch: t.get(b), lambda e=entries: t.put(e),
                     lambda b=batch: t.probe(b)):
            t0 = time.monotonic()
            try:
                result: Any = call()
            except Exception as exc:  # noqa: BLE001 - recorded; the test asserts there is none
                result = exc
            log.append((time.monotonic() - t0, result))
        i += 8


def _eventually(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_sigkill_master_under_load_then_recovery(cluster: RedisClusterServers,
                                                 tiers: Callable[..., RedisTier]) -> None:
    cluster.flushall()
    t = tiers(cluster.url)
    keys = [key_of(f"kill{i}") for i in range(48)]
    assert t.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * len(keys)
    victim = cluster.nodes[1]
    on_victim = [k for k in keys if _owner(cluster, t.redis_key(k)) is victim]
    elsewhere = [k for k in keys if k not in on_victim]
    assert on_victim and elsewhere
    stop, log = threading.Event(), []  # type: ignore[var-annotated]
    worker = threading.Thread(target=_load_loop, args=(t, keys, stop, log))
    worker.start()
    try:
        time.sleep(0.3)
        victim.kill()
        time.sleep(0.5)
        # the survivors keep serving their slots; the dead master's keys miss at once
        t0 = time.monotonic()
        got = t.get(elsewhere + on_victim)
        assert time.monotonic() - t0 < 0.5
        assert got[: len(elsewhere)] == [chunk_for(k) for k in elsewhere]
        assert got[len(elsewhere):] == [Miss(NODE_DOWN)] * len(on_victim)
        probe = t.probe(elsewhere[:2] + on_victim[:1] + elsewhere[2:])
        assert (probe.hits, probe.reason) == (2, NODE_DOWN)
        assert victim.addr in t.down_nodes()
        victim.start()  # same port, same dir (nodes.conf): rejoins with its slots, empty
        cluster.wait_ok()
        assert _eventually(lambda: t.put([Entry(k, chunk_for(k)) for k in on_victim])
                           == [True] * len(on_victim))
        assert t.get(on_victim) == [chunk_for(k) for k in on_victim]
        assert t.down_nodes() == []
    finally:
        stop.set()
        worker.join(20)
    assert not worker.is_alive()
    assert not [r for _, r in log if isinstance(r, Exception)]
    misses = [m for _, r in log if isinstance(r, list) for m in r if isinstance(m, Miss)]
    assert {m.reason for m in misses} <= {NODE_DOWN, TIMEOUT, ABSENT}
    assert any(m.reason == NODE_DOWN for m in misses)
    assert max(d for d, _ in log) < FAST["timeout_s"] + 1.0
    assert t.failures["node_down"] > 0


def test_failover_to_a_replica_is_picked_up(tiers: Callable[..., RedisTier]) -> None:
    """A master dies and its replica takes over: the tier must find the slots' new master on
    its own. (It used to skip the dead node's commands forever, so nothing refreshed the map.)"""
    c = RedisClusterServers(replicas=1).start()
    try:
        t = tiers(c.url)
        keys = [key_of(f"fo{i}") for i in range(24)]
        assert t.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * len(keys)
        victim = _owner(c, t.redis_key(keys[0]))
        on_victim = [k for k in keys if _owner(c, t.redis_key(k)) is victim]
        victim.kill()
        assert t.get(on_victim)[0] in (Miss(NODE_DOWN), Miss(TIMEOUT))  # noticed it is down
        survivor = next(n for n in c.nodes if n is not victim and n.client().info(
            "replication")["role"] == "master")
        assert _eventually(lambda: b"cluster_state:ok" in survivor.client().execute_command(
            "CLUSTER", "INFO"), 20)  # the replica was promoted
        # Writes reach the new master and reads hit, without any restart of the dead node.
        assert _eventually(lambda: t.put([Entry(k, chunk_for(k)) for k in on_victim])
                           == [True] * len(on_victim), 15)
        assert t.get(on_victim) == [chunk_for(k) for k in on_victim]
        assert _eventually(lambda: victim.addr not in t.down_nodes(), 10)
    finally:
        c.cleanup()


def test_one_master_refusing_auth_spares_the_others(tiers: Callable[..., RedisTier]) -> None:
    """A rolling password rotation reached one master first: its keys miss, the other
    masters' keys keep hitting (they used to fail with it, on every call)."""
    c = RedisClusterServers(password="old").start()
    try:
        t = tiers(c.url, password="old")
        keys = [key_of(f"auth{i}") for i in range(24)]
        assert t.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * len(keys)
        rotated = c.nodes[2]
        healthy = [k for k in keys if _owner(c, t.redis_key(k), "old") is not rotated]
        raw = rotated.client()
        raw.config_set("requirepass", "new")
        raw.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        t.get(keys)  # the batch that meets the refusal
        got = t.get(keys)
        assert [g for k, g in zip(keys, got) if k in healthy] == [chunk_for(k) for k in healthy]
        assert {g.reason for g in got if isinstance(g, Miss)} == {NODE_DOWN}
        assert rotated.addr in t.down_nodes() and t.failures["auth"] > 0
    finally:
        c.cleanup()


def test_lazy_start_before_the_cluster_exists(tiers: Callable[..., RedisTier]) -> None:
    ports = tuple(free_port(cluster_bus=True) for _ in range(3))
    url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in ports)
    with pytest.raises(TierUnavailableError, match="lazy_connect"):
        tiers(url)
    t = tiers(url, lazy_connect=True)
    key = key_of("lazy-cluster")
    assert t.get([key]) == [Miss(NODE_DOWN)]
    assert t.put([Entry(key, b"z" * 10)]) == [False]
    c = RedisClusterServers(ports=ports).start()
    try:
        assert _eventually(lambda: t.put([Entry(key, b"z" * 10)]) == [True])
        assert t.get([key]) == [b"z" * 10]
    finally:
        c.cleanup()


def test_wrong_password_on_a_cluster(tiers: Callable[..., RedisTier]) -> None:
    c = RedisClusterServers(password="s3cret").start()
    try:
        bad = c.url.replace("//", "//:wrong@")
        with pytest.raises(TierUnavailableError, match="credentials"):
            tiers(bad)
        with pytest.raises(TierUnavailableError, match="credentials"):
            tiers(c.url)  # no password at all
        t = tiers(c.url, password="s3cret")
        assert t.put([Entry(key_of("pw"), b"p" * 10)]) == [True]
    finally:
        c.cleanup()


def test_tls_cluster(tmp_path: Any, tiers: Callable[..., RedisTier]) -> None:
    tls = make_tls_files(tmp_path / "tls")
    c = RedisClusterServers(tls=tls).start()
    try:
        t = tiers(c.url, tls_ca=tls["ca"])
        keys = [key_of(f"tls{i}") for i in range(30)]
        assert t.put([Entry(k, chunk_for(k, tokens=1)) for k in keys]) == [True] * 30
        assert t.get(keys) == [chunk_for(k, tokens=1) for k in keys]
        assert min(c.dbsizes()) > 0
        with pytest.raises(TierUnavailableError, match="TLS"):  # certificate not trusted
            tiers(c.url)
    finally:
        c.cleanup()

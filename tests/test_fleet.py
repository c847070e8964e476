"""Node-local kvtier-servers over one Redis Cluster (kvtier.server.lower), all real processes:
a 3-master Redis Cluster, two kvtier-server "nodes" with ``lower: redis``, and engine
processes (tests/_fleet_engine.py) that reach their own node over the shared-memory path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from kvtier.config import GrpcTierConfig, RedisTierConfig
from kvtier.server.lower_io import WriteThrough
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server
from tests.redis_servers import FAST, RedisClusterServers, RedisServer, have_redis

pytestmark = pytest.mark.skipif(not have_redis(), reason="redis-server/redis-cli not installed")
ENGINE = Path(__file__).with_name("_fleet_engine.py")
ROOT = Path(__file__).resolve().parent.parent
TOKENS = {"alice": "tok-alice-0123456789", "bob": "tok-bob-0123456789"}
CHUNKS = 4  # per prefix (tests/_fleet_engine.py)


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    c = RedisClusterServers().start()
    yield c
    c.cleanup()


@pytest.fixture(scope="module")
def nodes(cluster: RedisClusterServers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProc]]:
    work = tmp_path_factory.mktemp("fleet")
    tokens = work / "tokens"
    tokens.write_text("".join(f"{tok} {tenant}\n" for tenant, tok in TOKENS.items()))
    redis_set = [a for k, v in FAST.items() for a in ("--set", f"redis.{k}={v}")]
    started: list[ServerProc] = []
    try:
        for name in ("node1", "node2"):
            started.append(start_server(work / name, "--lower", "redis", "--redis-url", cluster.url,
                                        "--tokens-file", str(tokens), *redis_set, name=name))
        yield started
    finally:
        for s in started:
            s.stop()


def engine(node: ServerProc, op: str, first: int, count: int, tenant: str = "alice",
           wait_s: float = 30.0) -> dict[str, Any]:
    """Run one engine process against ``node``; a non-zero exit (any exception) fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "connectors"),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ENGINE), node.address, op, str(first), str(count),
                           "--wait-s", str(wait_s), "--token", TOKENS[tenant]], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, f"engine {op} on {node.name} failed:\n{done.stderr[-4000:]}"
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def stats(node: ServerProc, tenant: str = "alice") -> dict[str, Any]:
    with urllib.request.urlopen(node.http + "/api/stats", timeout=5) as r:
        doc = json.loads(r.read())
    (t,) = [t for t in doc["tenants"] if t["tenant"] == tenant]
    return dict(t)


def wait_for(cond: Any, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.05)


def redis_keys(cluster: RedisClusterServers, pattern: str) -> int:
    return sum(len(list(n.client().scan_iter(match=pattern, count=1000))) for n in cluster.nodes
               if n.proc is not None and n.proc.poll() is None)


def test_node2_restores_what_node1_wrote(nodes: list[ServerProc], cluster: RedisClusterServers) -> None:
    node1, node2 = nodes
    saved = engine(node1, "save", 0, 8)
    assert saved == {"data_path": "shm", "stored_chunks": 8 * CHUNKS}
    seen = engine(node2, "wait", 0, 8)
    assert seen["pending"] == [], seen
    got = engine(node2, "load", 0, 8)
    assert got["data_path"] == "shm"
    assert got["hit_chunks"] == [CHUNKS] * 8 and got["wrong_chunks"] == 0
    # node 2 read each chunk from the cluster once (prefetched at lookup, or at the Get) and
    # promoted it: a second restore is node-local
    first = stats(node2)
    from_redis = first["lower"]["prefetched"] + first["get"]["hit_chunks"].get("redis", 0)
    assert from_redis == 8 * CHUNKS, first
    again = engine(node2, "load", 0, 8)
    assert again["hit_chunks"] == [CHUNKS] * 8 and again["wrong_chunks"] == 0
    after = stats(node2)
    assert after["lower"]["prefetched"] + after["get"]["hit_chunks"].get("redis", 0) == from_redis
    (cpu,) = [t for t in after["tiers"] if t["name"] == "cpu"]
    assert cpu["entries"] >= 8 * CHUNKS, after
    # tenancy: alice's chunks live under her own prefix; bob sees none of them
    assert redis_keys(cluster, "kvtier:alice:v1:*") == 8 * CHUNKS
    assert redis_keys(cluster, "kvtier:bob:*") == 0
    assert engine(node2, "load", 0, 8, tenant="bob")["hit_chunks"] == [0] * 8
    lower = stats(node1)["lower"]
    assert lower["written"] == 8 * CHUNKS and lower["dropped"] == lower["failed"] == 0, lower
    text = node1.metrics()
    assert f'kvtier_server_lower_writes_total{{outcome="written",tenant="alice"}} {8 * CHUNKS}.0' in text


def test_master_killed_costs_misses_never_errors_then_recovers(
        nodes: list[ServerProc], cluster: RedisClusterServers) -> None:
    node1, node2 = nodes
    before = redis_keys(cluster, "kvtier:alice:v1:*")
    assert engine(node1, "save", 100, 24)["stored_chunks"] == 24 * CHUNKS
    # written through to the cluster (watched there: a lookup on node 2 would prefetch)
    wait_for(lambda: redis_keys(cluster, "kvtier:alice:v1:*") == before + 24 * CHUNKS)
    victim = cluster.nodes[0]
    victim.kill()
    try:
        got = engine(node2, "load", 100, 24)
        assert got["wrong_chunks"] == 0
        # a third of the slots is gone: some prefixes stop early, the others are whole
        assert 0 < got["missed_chunks"] < 24 * CHUNKS, got
        # node 1 keeps taking Puts; what it cannot write through is counted, not raised
        assert engine(node1, "save", 200, 12)["stored_chunks"] == 12 * CHUNKS
        wait_for(lambda: stats(node1)["lower"]["queue_chunks"] == 0)
        lower = stats(node1)["lower"]
        assert lower["failed"] > 0 and lower["written"] + lower["failed"] + lower["dropped"] \
            == lower["queued"] + lower["dropped"], lower
        misses = stats(node2)["get"]["miss_chunks"]
        assert set(misses) <= {"node_down", "timeout", "absent"} and misses, misses
    finally:
        victim.start()
        cluster.wait_ok()
    # recovery: new prefixes written on node 1 are all restored on node 2 again
    engine(node1, "save", 300, 8)
    assert engine(node2, "wait", 300, 8)["pending"] == []
    got = engine(node2, "load", 300, 8)
    assert got["hit_chunks"] == [CHUNKS] * 8 and got["wrong_chunks"] == 0


def test_write_through_queue_is_bounded_drops_and_counts(tmp_path: Path) -> None:
    server = RedisServer().start()
    tier = RedisTier(RedisTierConfig(url=server.url, **{**FAST, "timeout_s": 3.0}))
    writer = WriteThrough(tier, max_bytes=1 << 20, name="test-writer")
    try:
        assert server.proc is not None
        os.kill(server.proc.pid, signal.SIGSTOP)  # Redis stalls: nothing the writer sends returns
        keys = make_keys(21, seed=7)
        writer.offer(Entry(k, bytes([i]) * 65536) for i, k in enumerate(keys))
        snap = writer.snapshot()
        assert (snap["queued"], snap["dropped"]) == (16, 5), snap  # 16 x 64 KiB = the bound
        assert snap["queue_bytes"] == 1 << 20
        os.kill(server.proc.pid, signal.SIGCONT)
        assert writer.flush(10.0)
        snap = writer.snapshot()
        assert snap["written"] == 16 and snap["failed"] == 0 and snap["queue_bytes"] == 0, snap
        assert tier.get(keys[:16]) == [bytes([i]) * 65536 for i in range(16)]
        writer.close(1.0)
        writer.offer([Entry(keys[20], b"x" * 100)])  # closed: dropped, counted
        assert writer.snapshot()["dropped"] == 6
    finally:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)
        writer.close(1.0)
        tier.close()
        server.cleanup()


def test_grpc_path_reads_the_cluster_and_never_serves_a_corrupt_value(
        nodes: list[ServerProc], cluster: RedisClusterServers) -> None:
    """Without a lookup first (no prefetch) and over gRPC instead of shm: node 2's Get reads
    Redis itself; a value in Redis that is not the chunk of its key is a ``corrupt`` miss."""
    node1, node2 = nodes
    t1, t2 = (GrpcTier(GrpcTierConfig(enabled=True, nodes=(n.address,), token=TOKENS["alice"],
                                      data_path="grpc")) for n in (node1, node2))
    try:
        keys = make_keys(6, seed=99)
        chunks = [make_chunk(k, 20_000, i) for i, k in enumerate(keys)]
        assert t1.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 6
        prefix = "kvtier:alice:v1:"
        wait_for(lambda: all(redis_value(cluster, prefix + k.hex()) is not None for k in keys))
        # tamper with two values in Redis: another key's chunk, and a flipped payload byte
        set_redis_value(cluster, prefix + keys[4].hex(), chunks[0])
        bad = bytearray(chunks[5])
        bad[-1] ^= 0xFF
        set_redis_value(cluster, prefix + keys[5].hex(), bytes(bad))
        got = t2.get(keys)
        assert got[:4] == chunks[:4]
        assert [type(v).__name__ for v in got[4:]] == ["Miss", "Miss"]
        misses = stats(node2)["get"]["miss_chunks"]
        assert misses.get("corrupt", 0) >= 2, misses
        # the good ones were promoted, the corrupt ones were not
        assert t2.get(keys[:4]) == chunks[:4]
        assert all(isinstance(v, Miss) for v in t2.get(keys[4:]))
    finally:
        t1.close()
        t2.close()


def _cluster_client(cluster: RedisClusterServers) -> RedisCluster:
    return RedisCluster(host="127.0.0.1", port=cluster.nodes[1].port, socket_timeout=2)


def redis_value(cluster: RedisClusterServers, name: str) -> bytes | None:
    with _cluster_client(cluster) as c:
        value = c.get(name)
    return None if value is None else bytes(value)


def set_redis_value(cluster: RedisClusterServers, name: str, value: bytes) -> None:
    with _cluster_client(cluster) as c:
        c.set(name, value)

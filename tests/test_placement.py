"""Placement v1 (kvtier/tiers/remote/placement.py, docs/placement.md) as a pure function:
committed vectors, an independent re-implementation of the written rule, balance, movement,
groups; and the membership resolvers' parsing. No servers: the cluster tests are in
test_grpc_cluster.py."""

from __future__ import annotations

import bisect
import importlib.util
import json
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.tiers.remote.membership import ResolveError, dns_resolver, node_name, resolver_for
from kvtier.tiers.remote.placement import (
    PLACEMENT_VERSION,
    VNODES,
    Ring,
    key_positions,
    prefix_placement,
    probe_waves,
)
from tests.kvtier_servers import make_keys

REPO = Path(__file__).resolve().parent.parent
VECTORS = REPO / "tests" / "vectors" / "placement_v1.json"
MASK = (1 << 64) - 1


def _mix64(z: int) -> int:
    z ^= z >> 30
    z = (z * 0xBF58476D1CE4E5B9) & MASK
    z ^= z >> 27
    z = (z * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference_place(nodes: list[str], key: bytes, replicas: int, vnodes: int = VNODES) -> list[str]:
    """docs/placement.md's rule in plain Python ints (no numpy, shares no code with Ring)."""
    points = sorted((_mix64((xxhash.xxh3_64_intdigest(n.encode()) + v * 0x9E3779B97F4A7C15) & MASK), n)
                    for n in sorted(set(nodes)) for v in range(1, vnodes + 1))
    values = [p for p, _ in points]
    i = bisect.bisect_left(values, int.from_bytes(key[:8], "little")) % len(points)
    out: list[str] = []
    while len(out) < min(replicas, len(set(nodes))):
        name = points[i % len(points)][1]
        if name not in out:
            out.append(name)
        i += 1
    return out


def test_vectors_pin_placement_v1() -> None:
    doc = json.loads(VECTORS.read_text())
    assert doc["version"] == PLACEMENT_VERSION and doc["vnodes"] == VNODES
    for case in doc["cases"]:
        keys = [bytes.fromhex(h) for h in case["keys_hex"]]
        ring = Ring(case["nodes"])
        assert prefix_placement(ring, keys, case["group"], case["replicas"]) == case["placement"]
        assert [ring.place(k, case["replicas"]) for k in keys] == case["placement_by_key"]
        seed = xxhash.xxh3_64_intdigest(case["nodes"][0].encode())
        assert [_mix64((seed + v * 0x9E3779B97F4A7C15) & MASK) for v in (1, 2, 3)] == case["first_node_points"]
        # The rule as written, on the same keys: the anchors' placement.
        g = case["group"]
        for d, reps in enumerate(case["placement"]):
            assert reps == reference_place(case["nodes"], keys[d - d % g], case["replicas"])


def test_ring_matches_the_written_rule_on_random_keys() -> None:
    nodes = [f"10.2.0.{i}:50051" for i in range(7)]
    ring = Ring(nodes, vnodes=64)
    for key in make_keys(300, seed=21):
        assert ring.place(key, 3) == reference_place(nodes, key, 3, vnodes=64)


def _shares(ring: Ring) -> np.ndarray:
    """Fraction of the key space each node owns (as primary)."""
    pts = ring.points.astype(np.float64)
    arcs = np.diff(np.concatenate([[pts[-1] - 2.0**64], pts]))  # arc ending at each point
    return np.bincount(ring.owners, weights=arcs, minlength=len(ring)) / 2.0**64


@pytest.mark.parametrize("n", [100, 300])
def test_balance_at_100_plus_nodes(n: int) -> None:
    shares = _shares(Ring([f"node-{i}.kvtier:50051" for i in range(n)]))
    assert abs(shares.sum() - 1.0) < 1e-9
    assert shares.max() / shares.mean() <= 1.1, shares.max() / shares.mean()


def test_a_join_moves_only_keys_to_the_new_node_and_about_1_over_n() -> None:
    n = 50
    nodes = [f"10.3.0.{i}:50051" for i in range(n)]
    before, after = Ring(nodes), Ring([*nodes, "10.3.1.0:50051"])
    keys = make_keys(20_000, seed=22)
    old = before.place_keys(keys, 2)
    new = after.place_keys(keys, 2)
    moved = [k for k, a, b in zip(keys, old, new) if a[0] != b[0]]
    assert all(after.place(k, 1) == ["10.3.1.0:50051"] for k in moved)
    assert len(moved) / len(keys) <= 1.5 / n, len(moved) / len(keys)
    # Replica sets change only by the newcomer taking a place.
    for a, b in zip(old, new):
        assert [x for x in b if x != "10.3.1.0:50051"] == a[: len([x for x in b if x != "10.3.1.0:50051"])]


def test_groups_share_nodes_and_spread_over_the_ring() -> None:
    ring = Ring([f"10.4.0.{i}:50051" for i in range(64)])
    keys = make_keys(512, seed=23)
    placed = prefix_placement(ring, keys, 16, 2)
    for d in range(512):
        assert placed[d] == placed[d - d % 16]
    touched = {n for reps in placed for n in reps}
    assert len(touched) <= (512 // 16) * 2
    assert len({tuple(p) for p in placed}) > 16  # the 32 groups do not pile up on few nodes
    with pytest.raises(ValueError, match="group"):
        prefix_placement(ring, keys, 0, 1)


def test_replicas_are_distinct_and_capped_by_the_node_count() -> None:
    ring = Ring(["a:1", "b:1"])
    for key in make_keys(50, seed=24):
        reps = ring.place(key, 3)
        assert sorted(reps) == ["a:1", "b:1"]
    with pytest.raises(ValueError, match="at least one node"):
        Ring([])


def test_one_node_ring_places_as_the_ring_lookup_does() -> None:
    """place_keys skips the ring lookup for a one-node ring: same names as the lookup,
    same refusal of a too-short key."""
    ring = Ring(["only:1"])
    keys = make_keys(20, seed=25)
    for replicas in (1, 3):
        looked_up = [[ring.names[i] for i in row] for row in ring.replicas_at(key_positions(keys), replicas)]
        assert ring.place_keys(keys, replicas) == looked_up == [["only:1"]] * 20
    with pytest.raises(ValueError, match="at least 8 bytes"):
        ring.place_keys([b"short"], 1)


def test_discovery_settings_are_parsed_or_refused_by_name() -> None:
    assert node_name("::1", 7) == "[::1]:7" and node_name("kvtier-0.svc.", 7) == "kvtier-0.svc:7"
    for bad in ("dns:nohostport", "dns:host:notaport", "dns:host:70000", "ftp:x", "srv:"):
        with pytest.raises(ValueError, match="grpc.discovery"):
            resolver_for(bad)
    with pytest.raises(ConfigError, match="grpc.discovery"):
        KVTierConfig.from_dict({"grpc": {"discovery": "consul:x"}})
    with pytest.raises(ConfigError, match="grpc.group_chunks"):
        KVTierConfig.from_dict({"grpc": {"group_chunks": 0}})
    with pytest.raises(ConfigError, match="grpc.hedge_after"):
        KVTierConfig.from_dict({"grpc": {"hedge_after": 2}})


def test_dns_resolver_reads_a_and_aaaa_records() -> None:
    """localhost through the system resolver: the same call a headless Service name takes."""
    want = sorted({node_name(str(i[4][0]), 7001) for i in socket.getaddrinfo("localhost", 7001,
                                                                               type=socket.SOCK_STREAM)})
    got = resolver_for("dns:localhost:7001")()
    assert got == want and "127.0.0.1:7001" in got
    with pytest.raises(ResolveError):
        dns_resolver("no-such-host.invalid", 1)()


def _cluster_sim() -> Any:
    spec = importlib.util.spec_from_file_location("kvtier_bench_cluster_sim", REPO / "bench" / "cluster_sim.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_simulator_fleet_stops_at_the_first_missing_group() -> None:
    """bench/cluster_sim.py's fleet (real placement, real MemoryTier indexes): a stored
    512-chunk prefix is a full hit asking at most ceil(512/G) x R nodes; a prefix that shares
    only its first 100 chunks hits 100 and asks no node beyond the wave holding chunk 100."""
    sim = _cluster_sim()
    fleet = sim.Fleet(64, 8, 2, capacity_chunks=10_000)
    first = sim.chain(b"sim test", 512)
    assert fleet.lookup_and_store(first)[0] == 0
    hits, asked, _ = fleet.lookup_and_store(first)
    assert hits == 512 and len(asked) <= (512 // 8) * 2
    other = first[:100] + sim.chain(b"sim test other", 412, start=first[99])
    hits, asked, _ = fleet.lookup_and_store(other)
    anchors, placement = sim.place_prefix(fleet.ring, other, 8, 2)
    waves = probe_waves(anchors)
    last = next(hi for lo, hi in waves if lo <= 100 < hi)
    assert hits == 100
    assert asked == {n for p in range(last) for n in placement[p]}

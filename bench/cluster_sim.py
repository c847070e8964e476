"""Simulate a kvtier-server fleet with the real placement code and real store indexes, no network.

    python bench/cluster_sim.py [--quick] [--trace PATH] [--group 16] [--replicas 2]

What runs for real: ``kvtier.tiers.remote.placement`` (the ring, ``anchor_keys``,
``probe_waves``: the functions the grpc tier places and probes by) and, per simulated node,
a :class:`kvtier.tiers.memory.MemoryTier` (the store's reference index with the default
eviction policy) holding tiny stand-in values. What is simulated: the wire (a node call is a
method call) and time (the trace's timestamps).

It prints, then ends with one JSON line holding exactly ``placement_ms_1000_nodes``,
``fanout_p99``, ``load_max_over_mean``, ``moved_fraction_on_join``:

1. Placement time of one 512-chunk prefix (anchors + ring lookup, as the tier does it) at 3,
   64 and 1,000 nodes, min/median/max over repeats; the JSON takes the 1,000-node median.
2. Load: chunks per node for a generated fleet workload (2,000 groups per node, prefixes of
   1..512 chunks) at 100 and 1,000 nodes; the JSON takes the worst max/mean of the two.
3. Movement: the fraction of stored chunks whose primary node changes when one node joins
   (and leaves) at 100 and 1,000 nodes; the JSON takes the 1,000-node join (target 1.5 / N).
4. Replay through the indexes on 64 nodes: the Mooncake trace (``../shared/traces``; skipped
   with a message when absent) spread over 10,000 clients (1,000 with ``--quick``), plus
   512-chunk prompts sharing system prompts; fan-out = distinct nodes a lookup asks (the
   tier's probe waves, stopping after the wave with the first miss), median and p99, and the
   sockets the clients hold with idle close vs a full mesh. The JSON takes the p99 over both.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._stats import Stats, fmt  # noqa: E402
from kvtier.config import GrpcTierConfig  # noqa: E402
from kvtier.tiers.base import Entry  # noqa: E402
from kvtier.tiers.memory import MemoryTier  # noqa: E402
from kvtier.tiers.remote.placement import Ring, place, probe_waves  # noqa: E402

TRACE_CANDIDATES = [ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl",
                    ROOT.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"]
VALUE = b"v" * 64  # stand-in chunk bytes: the index, not the payload, is simulated
IDLE_S = 60.0  # grpc.idle_close_s default


def names(n: int) -> list[str]:
    return [f"kvtier-{i}.kvtier.ns.svc.cluster.local:50051" for i in range(n)]


def chain(seed: bytes, n: int, start: bytes = b"") -> list[bytes]:
    keys, prev = [], start or hashlib.sha256(seed).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev)
    return keys


def place_prefix(ring: Ring, prefix: Sequence[bytes], group: int, replicas: int) -> tuple[list[bytes], list[list[str]]]:
    """Exactly the tier's path (``placement.place``)."""
    return place(ring, prefix, prefix, group, replicas)


# --- 1. placement time ------------------------------------------------------------------------
def placement_time(sizes: Sequence[int], group: int, replicas: int, repeats: int) -> dict[int, Stats]:
    prefix = chain(b"timing", 512)
    out = {}
    for n in sizes:
        ring = Ring(names(n))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            place_prefix(ring, prefix, group, replicas)
            times.append((time.perf_counter() - t0) * 1e3)
        g1 = []
        for _ in range(max(5, repeats // 4)):
            t0 = time.perf_counter()
            place_prefix(ring, prefix, 1, replicas)
            g1.append((time.perf_counter() - t0) * 1e3)
        out[n] = Stats.of(times)
        print(f"placement of 512 keys, {n:>5} nodes, G={group}: {fmt(times, 'ms', 3)}; "
              f"G=1 (512 ring lookups): {fmt(g1, 'ms', 3)}")
    return out


# --- 2+3. load and movement -------------------------------------------------------------------
def group_workload(n_groups: int, group: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Anchor positions and chunk counts of about ``n_groups`` groups cut from prefixes of
    1..512 chunks (each prefix's last group holds the remainder)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 513, size=max(1, int(n_groups / (256 / group + 0.5))))
    per = -(-lengths // group)  # groups per prefix
    weights = np.full(int(per.sum()), float(group))
    weights[np.cumsum(per) - 1] = lengths - group * (per - 1)
    positions = np.frombuffer(rng.bytes(8 * len(weights)), dtype="<u8").astype(np.uint64)
    return positions, weights


def load_and_movement(sizes: Sequence[int], group: int, replicas: int) -> tuple[float, dict[int, tuple[float, float]]]:
    worst = 0.0
    moved: dict[int, tuple[float, float]] = {}
    for n in sizes:
        fleet = names(n)
        ring = Ring(fleet)
        pos, w = group_workload(2000 * n, group, seed=n)
        reps = ring.replicas_at(pos, replicas)
        load = np.zeros(n)
        for col in range(reps.shape[1]):
            load += np.bincount(reps[:, col], weights=w, minlength=n)
        ratio = float(load.max() / load.mean())
        worst = max(worst, ratio)
        primary = np.array(ring.names)[reps[:, 0]]
        joined = Ring([*fleet, "kvtier-new.kvtier.ns.svc.cluster.local:50051"])
        after_join = np.array(joined.names)[joined.replicas_at(pos, 1)[:, 0]]
        left = Ring(fleet[1:])
        after_leave = np.array(left.names)[left.replicas_at(pos, 1)[:, 0]]
        mj = float(w[primary != after_join].sum() / w.sum())
        ml = float(w[primary != after_leave].sum() / w.sum())
        moved[n] = (mj, ml)
        print(f"{n:>5} nodes: {len(pos):,} groups x R={replicas}: load max/mean {ratio:.3f} "
              f"(min/mean {load.min() / load.mean():.3f}); moved on a join {mj:.5f} = {mj * n:.2f}/N, "
              f"on a leave {ml:.5f} = {ml * n:.2f}/N")
    return worst, moved


# --- 4. replay through real indexes -----------------------------------------------------------
class Fleet:
    """One MemoryTier index per node; lookups and stores as the grpc tier makes them."""

    def __init__(self, n: int, group: int, replicas: int, capacity_chunks: int) -> None:
        self.ring = Ring(names(n))
        self.group, self.replicas = group, replicas
        self.index = {name: MemoryTier(capacity_chunks * len(VALUE), name=name) for name in self.ring.names}

    def lookup_and_store(self, prefix: list[bytes]) -> tuple[int, set[str], set[str]]:
        """Probe in waves (stop after the wave with the first miss), then store the rest on
        every replica. Returns (leading hits, nodes the lookup asked, nodes touched at all)."""
        anchors, placement = place_prefix(self.ring, prefix, self.group, self.replicas)
        asked: set[str] = set()
        hits = len(prefix)
        for lo, hi in probe_waves(anchors):
            present = set()
            per_node: dict[str, list[int]] = {}
            for p in range(lo, hi):
                for name in placement[p]:
                    per_node.setdefault(name, []).append(p)
            for name, positions in per_node.items():
                asked.add(name)
                got = self.index[name].probe([prefix[p] for p in positions]).hits
                present.update(positions[:got])
            gap = next((p for p in range(lo, hi) if p not in present), None)
            if gap is not None:
                hits = gap
                break
        per_node_put: dict[str, list[Entry]] = {}
        for p in range(len(prefix)):
            for name in placement[p]:
                if p < hits:
                    continue
                per_node_put.setdefault(name, []).append(Entry(prefix[p], VALUE, p, prefix[p - 1] if p else b""))
        for name, entries in per_node_put.items():
            self.index[name].put(entries)
        if hits:
            for name in {n for p in range(hits) for n in placement[p][:1]}:
                self.index[name].get([prefix[p] for p in range(hits) if placement[p][0] == name])
        return hits, asked, asked | set(per_node_put)


def load_trace() -> list[tuple[float, list[int]]] | None:
    for path in TRACE_CANDIDATES:
        if path.exists():
            with path.open() as f:
                return [(float(r["timestamp"]) / 1000, list(r["hash_ids"])) for r in map(json.loads, f) if r]
    return None


def replay(n: int, group: int, replicas: int, clients: int, prompts_512: int) -> list[int]:
    trace = load_trace()
    fanouts: list[int] = []
    if trace is None:
        print(f"trace: none of {[str(p) for p in TRACE_CANDIDATES]} exists; skipping the trace replay")
    else:
        fleet = Fleet(n, group, replicas, capacity_chunks=20_000)
        last_use: list[dict[str, float]] = [{} for _ in range(clients)]
        peak = 0
        hit_blocks = total = 0
        t_fan = []
        for i, (ts, ids) in enumerate(trace):
            prefix = [hashlib.sha256(b"trace block " + h.to_bytes(8, "little")).digest() for h in ids]
            hits, asked, touched = fleet.lookup_and_store(prefix)
            t_fan.append(len(asked))
            hit_blocks += hits
            total += len(prefix)
            client = last_use[i % clients]
            for name in touched:
                client[name] = ts
            if i % 200 == 0:  # sockets held now: nodes each client used within the idle window
                peak = max(peak, sum(1 for c in last_use for t in c.values() if ts - t < IDLE_S))
        fanouts.extend(t_fan)
        print(f"trace replay, {n} nodes, G={group}, R={replicas}: {len(trace)} requests, leading-block hit "
              f"ratio {hit_blocks / total:.3f}; fan-out median {np.median(t_fan):.0f}, p99 "
              f"{np.percentile(t_fan, 99):.0f}, max {max(t_fan)} nodes")
        print(f"  {clients:,} clients: peak open node connections {peak:,} with idle close after "
              f"{IDLE_S:.0f}s, vs {clients * n:,} for a full mesh")
    fleet = Fleet(n, group, replicas, capacity_chunks=200_000)
    systems = [chain(f"system prompt {s}".encode(), 64 * (1 + s % 4)) for s in range(20)]
    f512 = []
    for rnd in range(2):  # the second round finds what the first stored
        for c in range(prompts_512):
            sp = systems[c % len(systems)]
            tail = chain(f"user {c}".encode(), 512 - len(sp), start=sp[-1])
            hits, asked, _ = fleet.lookup_and_store(sp + tail)
            if rnd == 1:
                f512.append(len(asked))
                assert hits == 512, hits
    print(f"512-chunk prompts, {n} nodes: fan-out of a full hit median {np.median(f512):.0f}, p99 "
          f"{np.percentile(f512, 99):.0f} nodes (bound ceil(512/G) x R = {math.ceil(512 / group) * replicas})")
    return fanouts + f512


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, clients and prompts")
    ap.add_argument("--group", type=int, default=GrpcTierConfig().group_chunks, help="grpc.group_chunks (G)")
    ap.add_argument("--replicas", type=int, default=2, help="grpc.replication (R)")
    ap.add_argument("--nodes", type=int, default=64, help="fleet size of the replay")
    args = ap.parse_args()
    times = placement_time([3, 64, 1000], args.group, args.replicas, 50 if args.quick else 300)
    worst, moved = load_and_movement([100, 1000], args.group, args.replicas)
    fanouts = replay(args.nodes, args.group, args.replicas, 1000 if args.quick else 10_000,
                     100 if args.quick else 400)
    print(json.dumps({"placement_ms_1000_nodes": round(times[1000].median, 4),
                      "fanout_p99": float(np.percentile(fanouts, 99)),
                      "load_max_over_mean": round(worst, 4),
                      "moved_fraction_on_join": round(moved[1000][0], 6)}))


if __name__ == "__main__":
    main()

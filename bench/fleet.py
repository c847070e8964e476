"""Node-local kvtier-servers over a Redis Cluster vs the Redis tier used directly, in one run.

    python bench/fleet.py [--quick] [--reps N] [--chunks N] [--chunk-mib M]

Starts a 3-master Redis Cluster (tests/redis_servers.py) and two kvtier-servers ("node 1",
"node 2") with ``lower: redis`` over it. Each rep writes a fresh prefix of ``--chunks``
chunks through node 1 (gRPC tier, shared-memory data path), waits until the cluster holds all
of it (``visible_s``: node 1's Put acknowledged -> node 2's lookup would find the whole
prefix; watched in the cluster, since a lookup on node 2 starts its prefetch), then measures
an engine's restore (one lookup, then the Get of what it found) on the same bytes:

- ``composed_cold``: node 2's first restore (client -> node 2 over shm; node 2's lookup finds
  the chunks in the cluster and prefetches them into its RAM, the Get takes them from there)
  -- the cross-node case;
- ``composed_warm``: the same restore again (node-local RAM only);
- ``redis_direct``: the library's redis tier doing the same lookup + Get on the cluster.

Direct and cold alternate which goes first per rep. Figures are min/median/max GB/s;
``composed_get_vs_redis_direct`` = median cold / median direct (the issue's key),
``composed_warm_get_vs_redis_direct`` = median warm / median direct. Then one master is
killed and node 2 restores prefixes written before the kill: ``kill_missed_chunks`` (misses
expected: a third of the slots is gone) and ``kill_errors`` (exceptions: must be 0), and
``kill_wrong_chunks`` (bytes that differ: must be 0). The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._stats import Stats, fmt, gbps, median
from kvtier.config import GrpcTierConfig, RedisTierConfig
from kvtier.errors import KVTierError
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server
from tests.redis_servers import FAST, RedisClusterServers, have_redis


def _tier(node: ServerProc) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(enabled=True, nodes=(node.address,), data_path="shm", timeout_s=30.0))


def _prefix(rep: int, chunks: int, nbytes: int) -> tuple[list[bytes], list[bytes]]:
    keys = make_keys(chunks, seed=10_000 + rep)
    return keys, [make_chunk(k, nbytes, seed=i) for i, k in enumerate(keys)]


def _wait_visible(tier: Any, keys: list[bytes], timeout: float = 60.0) -> float:
    start = time.perf_counter()
    while tier.probe(keys).hits < len(keys):
        if time.perf_counter() - start > timeout:
            raise RuntimeError(f"node 2 did not see the prefix within {timeout} s")
        time.sleep(0.001)
    return time.perf_counter() - start


def _timed_get(tier: Any, keys: list[bytes]) -> tuple[float, list[bytes | Miss]]:
    """An engine's restore: one lookup, then the Get of what it found."""
    start = time.perf_counter()
    hits = tier.probe(keys).hits
    values: list[bytes | Miss] = tier.get(keys[:hits])
    return time.perf_counter() - start, values


def _check(values: list[bytes | Miss], chunks: list[bytes], what: str) -> None:
    if values != chunks:
        raise RuntimeError(f"{what}: restored bytes differ from what was written")


def run(reps: int, chunks: int, chunk_bytes: int) -> dict[str, Any]:
    cluster = RedisClusterServers().start()
    work = Path(tempfile.mkdtemp(prefix="kvtier-fleet-bench-"))
    cpu = ("--cpu-bytes", f"{max(256, 4 * reps * chunks * (chunk_bytes >> 20) + 64)}MiB",
           "--slot-bytes", f"{(chunk_bytes >> 20) + 1}MiB")
    redis_set = [a for k, v in FAST.items() for a in ("--set", f"redis.{k}={v}")]
    nodes: list[ServerProc] = []
    tiers: list[Any] = []
    try:
        for name in ("node1", "node2"):
            nodes.append(start_server(work / name, *cpu, "--lower", "redis", "--redis-url", cluster.url,
                                      *redis_set, name=name))
        t1, t2 = _tier(nodes[0]), _tier(nodes[1])
        direct = RedisTier(RedisTierConfig(url=cluster.url, key_prefix="kvtier:default", timeout_s=30.0))
        tiers += [t1, t2, direct]
        cold: list[float] = []
        warm: list[float] = []
        red: list[float] = []
        visible: list[float] = []
        for rep in range(reps):
            keys, values = _prefix(rep, chunks, chunk_bytes)
            nbytes = sum(len(v) for v in values)
            if t1.put([Entry(k, v) for k, v in zip(keys, values)]) != [True] * chunks:
                raise RuntimeError("node 1 refused a Put")
            visible.append(_wait_visible(direct, keys))  # in the cluster (node 2 would prefetch)
            got: dict[str, list[bytes | Miss]] = {}
            order: list[tuple[str, Any, list[float]]] = [("cold", t2, cold), ("direct", direct, red)]
            for what, tier, sink in (order if rep % 2 else order[::-1]) + [("warm", t2, warm)]:
                seconds, got[what] = _timed_get(tier, keys)
                sink.append(gbps(nbytes, seconds))
            for what, restored in got.items():
                _check(restored, values, what)
        kill = _kill_round(cluster, t1, t2, direct, chunks, chunk_bytes)
    finally:
        for t in tiers:
            t.close()
        for n in nodes:
            n.stop()
        cluster.cleanup()
    result: dict[str, Any] = {
        "chunks": chunks, "chunk_bytes": chunk_bytes, "reps": reps,
        "composed_get_vs_redis_direct": median(cold) / median(red),
        "composed_warm_get_vs_redis_direct": median(warm) / median(red),
    }
    for name, values in (("composed_cold_gbps", cold), ("composed_warm_gbps", warm),
                         ("redis_direct_gbps", red), ("visible_s", visible)):
        s = Stats.of(values)
        result[name] = {"min": s.min, "median": s.median, "max": s.max}
    result.update(kill)
    print(f"node 2 restore through node-local server, cold (from cluster): {fmt(cold, 'GB/s')}")
    print(f"node 2 restore through node-local server, warm (node RAM):     {fmt(warm, 'GB/s')}")
    print(f"redis tier direct on the same keys:                            {fmt(red, 'GB/s')}")
    print(f"node 1 Put -> node 2 sees the prefix:                          {fmt(visible, 's', 4)}")
    print(f"master killed: {kill['kill_missed_chunks']} of {kill['kill_chunks']} chunks missed, "
          f"{kill['kill_errors']} errors, {kill['kill_wrong_chunks']} wrong chunks")
    return result


def _kill_round(cluster: RedisClusterServers, t1: GrpcTier, t2: GrpcTier, direct: RedisTier,
                chunks: int, chunk_bytes: int) -> dict[str, int]:
    """Write 4 prefixes through node 1, kill a master, restore them on node 2."""
    sets = [_prefix(1000 + i, chunks, chunk_bytes) for i in range(4)]
    for keys, values in sets:
        t1.put([Entry(k, v) for k, v in zip(keys, values)])
        _wait_visible(direct, keys)
    cluster.nodes[0].kill()
    missed = errors = wrong = 0
    try:
        for keys, values in sets:
            try:
                got = t2.get(keys)
            except (KVTierError, RuntimeError, OSError) as exc:  # counted: the figure must be 0
                print(f"restore raised: {exc!r}")
                errors += 1
                continue
            missed += sum(isinstance(v, Miss) for v in got)
            wrong += sum(not isinstance(v, Miss) and v != want for v, want in zip(got, values))
    finally:
        cluster.nodes[0].start()
    return {"kill_chunks": 4 * chunks, "kill_missed_chunks": missed, "kill_errors": errors,
            "kill_wrong_chunks": wrong}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 reps of 8 x 1 MiB chunks")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--chunks", type=int, default=None, help="chunks per prefix (default 32)")
    ap.add_argument("--chunk-mib", type=int, default=1)
    args = ap.parse_args()
    if not have_redis():
        sys.exit("bench/fleet.py needs redis-server and redis-cli")
    reps = args.reps or (3 if args.quick else 5)
    chunks = args.chunks or (8 if args.quick else 32)
    print(json.dumps(run(reps, chunks, args.chunk_mib << 20)))


if __name__ == "__main__":
    main()

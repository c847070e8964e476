"""The redis tier against raw redis-py on the same payloads, in one run.

    python bench/remote_redis.py [--quick] [--reps N]

Starts its own redis-server (free loopback port, no persistence) and a 3-master Redis Cluster,
then, for each, measures put and get of 1 MiB values, 4 concurrent clients, 8 values per round
trip: raw redis-py (``mset``/``mget`` on one node, ``mset_nonatomic``/``mget_nonatomic`` on the
cluster: pipelined, split per slot by redis-py, default client settings) against the redis tier
(``put``/``get``, plus ``get_into`` into preallocated buffers). The headline baseline,
"raw_tuned", is plain redis-py with the two connection settings the tier uses (the Python
command packer, which sends MiB values without copying them, and 1 MiB socket reads): tier /
raw_tuned (``*_vs_raw_tuned``) is the cost of the tier's own layers, like for like. tier / raw
(``*_vs_raw_default_packer``) is what a user sees against redis-py as shipped, whose hiredis
packer copies a whole MSET into one buffer: its put ratio (~5) measures that packer, not the
tier. Each figure is repeated
(>= 3 reps, raw and tier interleaved, order alternating per rep) and printed as
min/median/max GB/s; ratios are tier median / raw median. The last line is one JSON object.

Clients are threads of one process sharing one client object (one RedisTier, one redis.Redis):
that is how an engine uses a tier (its worker threads call one store), and redis-py releases
the GIL while it waits on sockets. Processes would mostly measure redis-server itself.

Other benches import :func:`run_redis_bench` and merge its dict into their JSON line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis
from redis.cluster import RedisCluster
from redis.connection import Connection, ConnectionPool

from bench._stats import fmt, gbps, median
from kvtier.config import RedisTierConfig
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.redis.conn import SOCKET_READ_SIZE, _construct_command_packer
from tests.redis_servers import RedisClusterServers, RedisServer, have_redis

VALUE_BYTES = 1 << 20
CLIENTS = 4
BATCH = 8  # values per round trip

Op = Callable[[int], None]  # one round trip of client c


class TunedConnection(Connection):
    """Plain redis-py connection with the tier's packer choice (nothing else of the tier)."""

    _construct_command_packer = _construct_command_packer


def tuned_single(port: int) -> redis.Redis:
    return redis.Redis(connection_pool=ConnectionPool(
        connection_class=TunedConnection, host="127.0.0.1", port=port,
        socket_read_size=SOCKET_READ_SIZE))


def tuned_cluster(port: int) -> RedisCluster:
    return RedisCluster(url=f"redis://127.0.0.1:{port}", connection_class=TunedConnection,
                        socket_read_size=SOCKET_READ_SIZE)


def _payloads() -> list[list[bytes]]:
    """Distinct, incompressible-looking 1 MiB values, BATCH per client (built once)."""
    out = []
    for c in range(CLIENTS):
        row = []
        for i in range(BATCH):
            seed = hashlib.sha256(f"{c}/{i}".encode()).digest()
            row.append((seed * (VALUE_BYTES // len(seed) + 1))[:VALUE_BYTES])
        out.append(row)
    return out


def _misses(results: list[Any]) -> int:
    return sum(1 for r in results if isinstance(r, Miss))


def _clients_wall(op: Op, rounds: int) -> float:
    """Seconds for CLIENTS threads to each run ``op`` ``rounds`` times, from a common start."""
    barrier = threading.Barrier(CLIENTS + 1)
    errors: list[BaseException] = []

    def worker(c: int) -> None:
        barrier.wait()
        try:
            for _ in range(rounds):
                op(c)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall


class _Case:
    """Raw redis-py vs the tier on one deployment (single node or cluster)."""

    def __init__(self, label: str, url: str, raw: Any, tuned: Any, cluster: bool) -> None:
        self.label = label
        self.tier = RedisTier(RedisTierConfig(url=url, timeout_s=10.0), name=f"bench-{label}")
        self.raw = raw
        self.tuned = tuned
        self.cluster = cluster
        self.values = _payloads()
        self.raw_names = [[f"bench:raw:{c}:{i}".encode() for i in range(BATCH)]
                          for c in range(CLIENTS)]
        self.keys = [[hashlib.sha256(f"bench:tier:{c}:{i}".encode()).digest()
                      for i in range(BATCH)] for c in range(CLIENTS)]
        self.entries = [[Entry(k, v) for k, v in zip(ks, vs)]
                        for ks, vs in zip(self.keys, self.values)]
        self.outs = [[memoryview(bytearray(VALUE_BYTES)) for _ in range(BATCH)]
                     for _ in range(CLIENTS)]

    # --- the ops ------------------------------------------------------------------------------
    def _put(self, client: Any, c: int) -> None:
        mapping = dict(zip(self.raw_names[c], self.values[c]))
        if self.cluster:
            client.mset_nonatomic(mapping)
        else:
            client.mset(mapping)

    def _get(self, client: Any, c: int) -> None:
        got = (client.mget_nonatomic if self.cluster else client.mget)(self.raw_names[c])
        if got[0] is None:
            raise RuntimeError("raw get missed")

    def raw_put(self, c: int) -> None:
        self._put(self.raw, c)

    def raw_get(self, c: int) -> None:
        self._get(self.raw, c)

    def raw_tuned_put(self, c: int) -> None:
        self._put(self.tuned, c)

    def raw_tuned_get(self, c: int) -> None:
        self._get(self.tuned, c)

    def tier_put(self, c: int) -> None:
        if not all(self.tier.put(self.entries[c])):
            raise RuntimeError(f"tier put dropped a value: {self.tier.failures}")

    def tier_get(self, c: int) -> None:
        if _misses(self.tier.get(self.keys[c])):
            raise RuntimeError(f"tier get missed: {self.tier.failures}")

    def tier_get_into(self, c: int) -> None:
        if _misses(self.tier.get_into(self.keys[c], self.outs[c])):
            raise RuntimeError(f"tier get_into missed: {self.tier.failures}")

    def verify(self) -> None:
        """Outside the timing: the tier returns exactly what was put, raw too."""
        self.raw_put(0)
        self.tier_put(0)
        assert self.tier.get(self.keys[0]) == self.values[0]
        raw = (self.raw.mget_nonatomic if self.cluster else self.raw.mget)(self.raw_names[0])
        assert raw == self.values[0]

    def run(self, reps: int, rounds: int) -> dict[str, list[float]]:
        nbytes = CLIENTS * rounds * BATCH * VALUE_BYTES
        ops: dict[str, Op] = {"raw_put": self.raw_put, "raw_tuned_put": self.raw_tuned_put,
                              "tier_put": self.tier_put, "raw_get": self.raw_get,
                              "raw_tuned_get": self.raw_tuned_get, "tier_get": self.tier_get,
                              "tier_get_into": self.tier_get_into}
        for c in range(CLIENTS):  # every key exists before the first timed get
            self.raw_put(c)
            self.tier_put(c)
        self.verify()
        results: dict[str, list[float]] = {name: [] for name in ops}
        for rep in range(reps):
            order = list(ops) if rep % 2 == 0 else list(reversed(ops))
            for name in order:
                results[name].append(gbps(nbytes, _clients_wall(ops[name], rounds)))
        return results

    def close(self) -> None:
        self.tier.close()
        self.raw.close()
        self.tuned.close()


def _summarise(label: str, res: dict[str, list[float]]) -> dict[str, float]:
    for name, values in res.items():
        print(f"  {label:7s} {name:14s} {fmt(values, 'GB/s')}")
    out = {
        # headline: the tier against redis-py with the same (non-copying) packer
        "get_vs_raw_tuned": median(res["tier_get"]) / median(res["raw_tuned_get"]),
        "put_vs_raw_tuned": median(res["tier_put"]) / median(res["raw_tuned_put"]),
        "get_into_vs_raw_tuned": median(res["tier_get_into"]) / median(res["raw_tuned_get"]),
        # against redis-py as shipped, whose hiredis packer copies a whole MSET: the put
        # ratio is that packer's cost, not the tier's merit
        "get_vs_raw_default_packer": median(res["tier_get"]) / median(res["raw_get"]),
        "put_vs_raw_default_packer": median(res["tier_put"]) / median(res["raw_put"]),
        "get_into_vs_raw_default_packer": median(res["tier_get_into"]) / median(res["raw_get"]),
    }
    for name, values in res.items():
        out[f"{name}_gbps"] = median(values)
    print(f"  {label:7s} tier/raw_tuned: get {out['get_vs_raw_tuned']:.3f}  put "
          f"{out['put_vs_raw_tuned']:.3f}  get_into {out['get_into_vs_raw_tuned']:.3f};  "
          f"tier/raw (default packer): get {out['get_vs_raw_default_packer']:.3f}  put "
          f"{out['put_vs_raw_default_packer']:.3f}  (medians)")
    return out


def run_redis_bench(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    """Run both deployments; return the flat dict of figures for a JSON line.

    Keys (single node, 1 MiB values, 4 clients): the headline
    ``redis_tier_{get,put,get_into}_vs_raw_tuned`` (tier / redis-py with the tier's packer),
    ``redis_tier_{get,put,get_into}_vs_raw_default_packer`` (tier / redis-py as shipped; were
    ``redis_tier_*_vs_raw``), ``redis_raw[_tuned]_{get,put}_gbps``,
    ``redis_tier_{get,put,get_into}_gbps``; the same with ``redis_cluster_`` in front for the
    3-master cluster, and the workload shape."""
    if not have_redis():
        return {"redis_skipped": "redis-server/redis-cli not installed"}
    reps = max(3, reps if reps is not None else (5 if quick else 7))
    rounds = 8 if quick else 16
    print(f"redis tier vs raw redis-py: {VALUE_BYTES >> 20} MiB values, {CLIENTS} client "
          f"threads, {BATCH} values per round trip, {rounds} round trips per client, {reps} reps")
    out: dict[str, Any] = {"redis_value_bytes": VALUE_BYTES, "redis_clients": CLIENTS,
                           "redis_batch": BATCH, "redis_reps": reps}
    single = RedisServer().start()
    cluster: RedisClusterServers | None = None
    try:
        case = _Case("single", single.url, redis.Redis(host="127.0.0.1", port=single.port),
                     tuned_single(single.port), cluster=False)
        try:
            res = _summarise("single", case.run(reps, rounds))
        finally:
            case.close()
        out.update({f"redis_tier_{k}": v for k, v in res.items() if "_vs_" in k})
        out.update({f"redis_{k}": v for k, v in res.items() if k.endswith("_gbps")})
        single.cleanup()
        cluster = RedisClusterServers().start()
        first = cluster.nodes[0]
        case = _Case("cluster", cluster.url, RedisCluster(host="127.0.0.1", port=first.port),
                     tuned_cluster(first.port), cluster=True)
        try:
            res = _summarise("cluster", case.run(reps, rounds))
        finally:
            case.close()
        out.update({f"redis_cluster_{k}": v for k, v in res.items()})
    finally:
        single.cleanup()
        if cluster is not None:
            cluster.cleanup()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer round trips and reps (< 60 s)")
    ap.add_argument("--reps", type=int, default=None, help="repeats per figure (>= 3)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = run_redis_bench(quick=args.quick, reps=args.reps)
    out["redis_bench_seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()

"""The server's lower tier: every tenant's RAM/disk stack over a Redis / Redis Cluster tier.

This is the node-local shape (``lower: redis``): engines on a host reach their node's
kvtier-server through shared memory; the node keeps what it serves in RAM/disk and shares it
with every other node through a cluster people already operate.

- Put: acknowledged once the node's own tiers took the chunk (as without a lower tier), then
  copied onto a bounded queue that one writer thread per tenant drains into Redis in batches.
  A full queue drops the chunk for the lower tier and counts it (``dropped``); a chunk Redis
  refuses (master down, OOM, timeout) is counted ``failed``. A Put never waits on Redis.
- Probe / Get: a run that stops in RAM/disk continues in Redis (one pipelined round trip per
  master touched). Chunks a lookup finds there are prefetched into the node's tiers in the
  background (the Get that follows waits for them instead of asking Redis chunk by chunk);
  a Get that still misses reads Redis itself. Chunks read from Redis are verified (header
  key, length, payload checksum) before they are served or promoted; a chunk that fails is
  a ``corrupt`` miss, never bytes handed on.
- Tenancy: tenant ``t``'s chunks live under the Redis key prefix ``<redis.key_prefix>:<t>``
  (one :class:`RedisTier` per tenant); quotas apply to the node's tiers only, Redis bounds
  itself (``maxmemory``, ``redis.ttl_s``).
- Links: a chunk read back from Redis is promoted with the depth and parent this node's Put of
  it gave (remembered, bounded: kvtier.server.chunk_links), else as a root: Redis keeps none.
- Failure: the redis tier never raises out of a verb (kvtier.tiers.redis): a dead master
  costs misses with reason ``node_down``/``timeout`` for the keys in its slots, and the tier
  re-pings it in the background, so recovery needs nothing from the operator.
- Accounting: the node's ``Traffic`` counts by tier, so a chunk served from Redis is a hit
  of tier ``redis`` (not a node-tier miss); the writer's counts are under ``"lower"`` in
  ``/api/stats`` and ``kvtier_server_lower_*`` on ``/metrics``.

Threads: verbs may be called from any thread (as :class:`TenantStore`'s); the writer and the
prefetcher (kvtier.server.lower_io) own one thread each per tenant. ``close`` drains the
queue for up to ``drain_s`` and drops the rest.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import xxhash
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.chunk import HEADER_SIZE, decode_header
from kvtier.errors import ChunkError
from kvtier.labelcap import LabelCap
from kvtier.server.auth import Tenant
from kvtier.server.config import ServerConfig
from kvtier.server.lower_io import WRITE_OUTCOMES, Prefetcher, WriteThrough
from kvtier.server.storage import Storage, TenantStore, Traffic
from kvtier.tiers.base import CORRUPT, Entry, Miss, Probe
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.redis import RedisTier
from kvtier.writebehind import Lineage


class LowerTraffic(Traffic):
    """``Traffic`` whose counts include the lower tier: the node's tiers count a chunk that
    Redis then served as a miss, so those misses are moved to hits of the lower tier (or to
    the lower tier's miss reason) when the snapshot is taken."""

    def __init__(self, tier_name: str, writer: Callable[[], dict[str, int]]) -> None:
        super().__init__()
        self._tier_name = tier_name
        self._writer = writer
        self._delta: dict[str, Counter[str]] = {"lookup": Counter(), "get": Counter()}
        self._lower_hits: Counter[str] = Counter()
        self._lower_bytes = 0
        self.prefetched = 0

    def moved(self, op: str, outcomes: Iterable[tuple[str, str | None]], nbytes: int = 0) -> None:
        """Each ``(node-tier miss reason, lower outcome)``; outcome None = served by Redis."""
        with self._lock:
            for old, new in outcomes:
                self._delta[op][old] -= 1
                if new is None:
                    self._lower_hits[op] += 1
                else:
                    self._delta[op][new] += 1
            self._lower_bytes += nbytes

    def count_prefetched(self, chunks: int) -> None:
        with self._lock:
            self.prefetched += chunks

    def snapshot(self) -> dict[str, Any]:
        doc = super().snapshot()
        with self._lock:
            for op, delta in self._delta.items():
                misses = Counter(doc[op]["miss_chunks"])
                misses.update(delta)
                doc[op]["miss_chunks"] = {k: v for k, v in misses.items() if v > 0}
                if self._lower_hits[op]:
                    doc[op]["hit_chunks"][self._tier_name] = self._lower_hits[op]
            doc["bytes_out"] += self._lower_bytes
        doc["lower"] = {**self._writer(), "prefetched": self.prefetched}
        return doc


def intact(key: bytes, value: bytes) -> bool:
    """Whether ``value`` is one whole, uncorrupted kvtier chunk of ``key``."""
    try:
        header = decode_header(value)
    except ChunkError:
        return False
    return (header.key == key and header.nbytes == len(value)
            and xxhash.xxh3_64_intdigest(memoryview(value)[HEADER_SIZE:]) == header.checksum)


class LoweredStore(TenantStore):
    """A tenant's node tiers (``TenantStore``) over ``lower``, which this store owns."""

    direct_puts = False  # put() also offers each chunk to the lower tier

    def __init__(self, *args: Any, lower: RedisTier, queue_bytes: int, drain_s: float,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lower = lower
        self.drain_s = drain_s
        self.writer = WriteThrough(lower, queue_bytes, f"kvtier-lower-{self.tenant.name}")
        self.traffic: LowerTraffic = LowerTraffic(lower.name, self.writer.snapshot)
        self.prefetcher = Prefetcher(self._prefetch, f"kvtier-prefetch-{self.tenant.name}")
        self._wait_s = 2 * lower.config.timeout_s
        # Depth and parent of the chunks this node's Puts gave Redis, for their read-back (Redis
        # keeps none; a chunk another node put is promoted as a root: kvtier.server.chunk_links).
        self.links = Lineage([lower.name])

    def probe(self, keys: Sequence[bytes]) -> Probe:
        local = super().probe(keys)
        rest = len(keys) - local.hits
        if not rest:
            return local
        more = self.lower.probe(keys[local.hits:])
        outcomes: list[tuple[str, str | None]] = [(local.reason, None)] * more.hits
        outcomes += [(local.reason, more.reason)] * (rest - more.hits)
        self.traffic.moved("lookup", outcomes)
        if more.hits:
            self.prefetcher.start(keys[local.hits:local.hits + more.hits])
        return Probe(local.hits + more.hits, more.reason)

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        self.prefetcher.wait(keys, self._wait_s)
        result = super().get(keys)
        missing = [i for i, v in enumerate(result) if isinstance(v, Miss)]
        if missing:
            for i, value in zip(missing, self._fetch(keys, missing, result)):
                result[i] = value
        return result

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        """As ``TenantStore.get_into``; a chunk fetched from Redis that does not fit its
        buffer is promoted first and then raises ValueError (a retry finds it locally)."""
        self.prefetcher.wait(keys, self._wait_s)
        result = super().get_into(keys, outs)
        missing = [i for i, v in enumerate(result) if isinstance(v, Miss)]
        if not missing:
            return result
        found = self._fetch(keys, missing, result)
        for i, value in zip(missing, found):
            if isinstance(value, Miss):
                result[i] = value
            elif len(value) > outs[i].nbytes:
                raise ValueError(f"buffer of {outs[i].nbytes} bytes is too small for a "
                                 f"{len(value)}-byte chunk")
            else:
                outs[i][: len(value)] = value
                result[i] = len(value)
        return result

    def _fetch(self, keys: Sequence[bytes], missing: Sequence[int],
               local: Sequence[object]) -> list[bytes | Miss]:
        """Chunks ``keys[i]`` for ``i`` in ``missing`` from Redis, verified; intact ones are
        promoted into the node's tiers (not written back to Redis)."""
        values = self.lower.get([keys[i] for i in missing])
        out: list[bytes | Miss] = []
        promote: list[Entry] = []
        outcomes: list[tuple[str, str | None]] = []
        nbytes = 0
        for i, value in zip(missing, values):
            old = local[i]
            assert isinstance(old, Miss)
            if not isinstance(value, Miss) and not intact(keys[i], value):
                value = Miss(CORRUPT)
            out.append(value)
            if isinstance(value, Miss):
                outcomes.append((old.reason, value.reason))
            else:
                outcomes.append((old.reason, None))
                promote.append(self.links.entry(keys[i], value))
                nbytes += len(value)
        if promote:
            TenantStore.put(self, promote)
        self.traffic.moved("get", outcomes, nbytes)
        return out

    def _prefetch(self, keys: list[bytes]) -> None:
        """Background: ``keys`` from Redis into the node's tiers (verified); not counted as
        request traffic (the Get that follows counts as a node-tier hit)."""
        promote = [self.links.entry(k, v) for k, v in zip(keys, self.lower.get(keys))
                   if not isinstance(v, Miss) and intact(k, v)]
        if promote:
            self.traffic.count_prefetched(sum(TenantStore.put(self, promote)))

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        stored = super().put(entries)
        offered = [e for e, ok in zip(entries, stored) if ok]
        self.links.chunks_stored(self.lower.name, offered)
        self.writer.offer(offered)
        return stored

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Deletes on this node and in Redis (so on every node that has not promoted it)."""
        existed = super().delete(keys)
        self.writer.discard(keys)
        return [self.lower.delete([key]) > 0 or had for key, had in zip(keys, existed)]

    def check(self) -> list[str]:
        problems = super().check()
        snap = self.writer.snapshot()
        if snap["queue_bytes"] < 0 or snap["queue_bytes"] > self.writer.max_bytes:
            problems.append(f"{self.tenant.name}/lower: queue_bytes {snap['queue_bytes']} "
                            f"outside 0..{self.writer.max_bytes}")
        return problems

    def close(self) -> None:
        try:
            self.prefetcher.close()
            self.writer.close(self.drain_s)
            self.lower.close()
        finally:
            super().close()


def store_factory(cfg: ServerConfig) -> Callable[[Tenant, CpuTier | None, DiskTier | None], TenantStore]:
    """How :class:`Storage` builds a tenant's store under ``cfg.lower``."""
    if cfg.lower == "none":
        return TenantStore

    def make(tenant: Tenant, ram: CpuTier | None, disk: DiskTier | None) -> TenantStore:
        redis_cfg = dataclasses.replace(cfg.redis, enabled=True,
                                        key_prefix=f"{cfg.redis.key_prefix}:{tenant.name}")
        tier = RedisTier(redis_cfg, name="redis")  # raises TierUnavailableError at start
        try:
            return LoweredStore(tenant, ram, disk, lower=tier, queue_bytes=cfg.lower_queue_bytes,
                                drain_s=cfg.grace_s)
        except BaseException:
            tier.close()
            raise

    return make


class LowerCollector(Collector):
    """``kvtier_server_lower_*`` for the stores that have a lower tier (none: no samples);
    ``tenant_label`` caps the tenant label (tenants folded into "other" are summed)."""

    def __init__(self, storage: Storage, tenant_label: LabelCap | None = None) -> None:
        self.storage = storage
        self.tenant_label = tenant_label if tenant_label is not None else LabelCap()

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        writes = CounterMetricFamily("kvtier_server_lower_writes", "Chunks for the lower tier, by "
                                     "outcome (queued, written, dropped: queue full, failed)",
                                     labels=["tenant", "outcome"])
        queue = GaugeMetricFamily("kvtier_server_lower_queue_bytes",
                                  "Bytes queued or in flight to the lower tier", labels=["tenant"])
        counts: dict[tuple[str, str], float] = {}
        queued: dict[str, float] = {}
        for name, store in list(self.storage.stores.items()):
            if isinstance(store, LoweredStore):
                tenant = self.tenant_label(name)
                snap = store.writer.snapshot()
                for outcome in WRITE_OUTCOMES:
                    counts[tenant, outcome] = counts.get((tenant, outcome), 0) + snap[outcome]
                queued[tenant] = queued.get(tenant, 0) + snap["queue_bytes"]
        for (tenant, outcome), n in counts.items():
            writes.add_metric([tenant, outcome], n)
        for tenant, n in queued.items():
            queue.add_metric([tenant], n)
        yield from (writes, queue)

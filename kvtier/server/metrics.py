"""kvtier-server's Prometheus metrics, in the server's own registry (served at /metrics).

Request counters and latencies are updated by the servicer and the data path; tenant usage is
read from the storage at scrape time by a collector, so it is never stale and costs nothing
between scrapes. Names follow ``kvtier_<subsystem>_<what>_<unit>`` (docs/metrics.md). The
``tenant`` label is capped (:mod:`kvtier.labelcap`, ``metrics_label_values`` in the server
config): tenants past the first N admitted are summed into ``tenant="other"``.

Every series whose label values are known up front is exposed from the first scrape, at 0:
a counter's first sample is invisible to ``rate()``, so a series born at its first hit
would hide those hits from every rate panel. Per tenant label that is its tiers x ops for
``kvtier_server_hit_chunks_total`` and the miss reasons (:data:`kvtier.metrics.MISS_REASONS`)
x ops for ``kvtier_server_miss_chunks_total``: bounded, since tenant labels are capped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.labelcap import DEFAULT_LIMIT, LabelCap
from kvtier.metrics import LATENCY_BUCKETS, MISS_REASONS
from kvtier.server.lower import LoweredStore
from kvtier.server.storage import Storage


class _StorageCollector(Collector):
    def __init__(self, storage: Storage, tenant_label: LabelCap) -> None:
        self.storage = storage
        self.tenant_label = tenant_label

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        # Sums per capped label set: two tenants folded into "other" must yield one sample.
        used: dict[tuple[str, ...], float] = {}
        chunk_bytes: dict[tuple[str, ...], float] = {}
        cap: dict[tuple[str, ...], float] = {}
        entries: dict[tuple[str, ...], float] = {}
        evictions: dict[tuple[str, ...], float] = {}
        hits: dict[tuple[str, ...], float] = {}
        misses: dict[tuple[str, ...], float] = {}

        def add(into: dict[tuple[str, ...], float], labels: tuple[str, ...], n: float) -> None:
            into[labels] = into.get(labels, 0) + n

        for name, store in list(self.storage.stores.items()):
            tenant = self.tenant_label(name)
            for usage in store.usage().tiers:
                add(used, (tenant, usage.name), usage.used_bytes)
                add(chunk_bytes, (tenant, usage.name), usage.chunk_bytes)
                add(cap, (tenant, usage.name), usage.capacity_bytes)
                add(entries, (tenant, usage.name), usage.entries)
                add(evictions, (tenant, usage.name), usage.evictions)
            traffic = store.traffic.snapshot()
            # The node's tiers, and a Redis tier below them (kvtier.server.lower) that serves hits too.
            served_by = [t.name for t in store.tiers]
            if isinstance(store, LoweredStore):
                served_by.append(store.lower.name)
            for op in ("lookup", "get"):
                for tier in served_by:  # declared at 0 (module docstring)
                    add(hits, (tenant, tier, op), 0)
                for reason in MISS_REASONS:
                    add(misses, (tenant, reason, op), 0)
                for tier, n in traffic[op]["hit_chunks"].items():
                    add(hits, (tenant, tier, op), n)
                for reason, n in traffic[op]["miss_chunks"].items():
                    add(misses, (tenant, reason, op), n)
        families: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, list[str],
                             dict[tuple[str, ...], float]]] = [
            (GaugeMetricFamily, "kvtier_server_tier_used_bytes", "Bytes of the tier's capacity the chunks "
             "held take (RAM: whole slots), so used / capacity reaches 1 when a put must evict",
             ["tenant", "tier"], used),
            (GaugeMetricFamily, "kvtier_server_tier_chunk_bytes", "Bytes of the chunks held (RAM: what "
             "the node's RAM budget counts; less than used_bytes when chunks do not fill their slots)",
             ["tenant", "tier"], chunk_bytes),
            (GaugeMetricFamily, "kvtier_server_tier_capacity_bytes",
             "Bytes a tenant may hold in a tier (its quota in the bottom tier)", ["tenant", "tier"], cap),
            (GaugeMetricFamily, "kvtier_server_tier_entries", "Chunks held", ["tenant", "tier"], entries),
            (CounterMetricFamily, "kvtier_server_evictions", "Chunks evicted to stay within capacity",
             ["tenant", "tier"], evictions),
            (CounterMetricFamily, "kvtier_server_hit_chunks", "Chunks found, by the tier that held them",
             ["tenant", "tier", "op"], hits),
            (CounterMetricFamily, "kvtier_server_miss_chunks", "Chunks not found, by reason "
             "(a lookup counts the chunks after the run stopped)", ["tenant", "reason", "op"], misses),
        ]
        for kind, metric, doc, labels, values in families:
            family = kind(metric, doc, labels=labels)
            for label_values, n in values.items():
                family.add_metric(list(label_values), n)
            yield family
        warm_ahead = self.storage.warm_ahead
        if warm_ahead is not None:  # server-wide: warm slots are a RAM-budget matter, not a tenant's
            yield GaugeMetricFamily("kvtier_server_ram_warm_bytes", "Free RAM slot bytes kept faulted in "
                                    "for the puts to come (resident, holding no chunk)", value=warm_ahead.warm_bytes())
            yield CounterMetricFamily("kvtier_server_ram_warmed_bytes", "Bytes of free RAM slots the "
                                      "warm-ahead thread faulted in before a put needed them",
                                      value=warm_ahead.warmed_bytes)


class ServerMetrics:
    """Thread-safe (prometheus_client locks); one per server process."""

    def __init__(self, storage: Storage | None = None, *, label_values: int = DEFAULT_LIMIT) -> None:
        self.registry = r = CollectorRegistry()
        self.tenant_label = LabelCap(label_values)
        self.requests = Counter("kvtier_server_requests_total", "Requests answered, by method and status",
                                ["method", "code"], registry=r)
        self.seconds = Histogram("kvtier_server_request_duration_seconds", "Request latency",
                                 ["method"], registry=r, buckets=LATENCY_BUCKETS)
        self.bytes = Counter("kvtier_server_chunk_bytes_total", "Chunk bytes moved",
                             ["direction", "path"], registry=r)
        for direction in ("in", "out"):  # declared at 0: a rate sees the first bytes too
            for path in ("grpc", "socket", "shm"):
                self.bytes.labels(direction, path)
        self.rejected = Counter("kvtier_server_rejected_chunks_total",
                                "Chunks refused by verification, by status", ["code"], registry=r)
        self.auth_failures = Counter("kvtier_server_auth_failures_total", "Requests refused by auth",
                                     ["code"], registry=r)
        # The codes each can carry (requests.BadRequest, auth.AuthError), declared at 0 so the
        # first refusal shows in a rate() rather than only creating the series.
        for code in ("INVALID_ARGUMENT", "DATA_LOSS", "RESOURCE_EXHAUSTED"):
            self.rejected.labels(code)
        for code in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
            self.auth_failures.labels(code)
        self.data_connections = Gauge("kvtier_server_data_connections", "Open data-path connections",
                                      registry=r)
        if storage is not None:
            r.register(_StorageCollector(storage, self.tenant_label))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

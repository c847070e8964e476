"""kvtier-server's Prometheus metrics, in the server's own registry (served at /metrics).

Request counters and latencies are updated by the servicer and the data path; tenant usage is
read from the storage at scrape time by a collector, so it is never stale and costs nothing
between scrapes. Names follow ``kvtier_<subsystem>_<what>_<unit>``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvtier.metrics import LATENCY_BUCKETS
from kvtier.server.storage import Storage


class _StorageCollector(Collector):
    def __init__(self, storage: Storage) -> None:
        self.storage = storage

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        used = GaugeMetricFamily("kvtier_server_tier_used_bytes", "Chunk bytes held",
                                 labels=["tenant", "tier"])
        cap = GaugeMetricFamily("kvtier_server_tier_capacity_bytes",
                                "Bytes a tenant may hold in a tier (its quota in the bottom tier)",
                                labels=["tenant", "tier"])
        entries = GaugeMetricFamily("kvtier_server_tier_entries", "Chunks held", labels=["tenant", "tier"])
        evictions = CounterMetricFamily("kvtier_server_evictions", "Chunks evicted to stay within capacity",
                                        labels=["tenant", "tier"])
        hits = CounterMetricFamily("kvtier_server_hit_chunks", "Chunks found, by the tier that held them",
                                   labels=["tenant", "tier", "op"])
        misses = CounterMetricFamily("kvtier_server_miss_chunks", "Chunks not found, by reason "
                                     "(a lookup counts the chunks after the run stopped)",
                                     labels=["tenant", "reason", "op"])
        for name, store in self.storage.stores.items():
            for usage in store.usage().tiers:
                used.add_metric([name, usage.name], usage.used_bytes)
                cap.add_metric([name, usage.name], usage.capacity_bytes)
                entries.add_metric([name, usage.name], usage.entries)
                evictions.add_metric([name, usage.name], usage.evictions)
            traffic = store.traffic.snapshot()
            for op in ("lookup", "get"):
                for tier, n in traffic[op]["hit_chunks"].items():
                    hits.add_metric([name, tier, op], n)
                for reason, n in traffic[op]["miss_chunks"].items():
                    misses.add_metric([name, reason, op], n)
        yield from (used, cap, entries, evictions, hits, misses)


class ServerMetrics:
    """Thread-safe (prometheus_client locks); one per server process."""

    def __init__(self, storage: Storage | None = None) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvtier_server_requests_total", "Requests answered, by method and status",
                                ["method", "code"], registry=r)
        self.seconds = Histogram("kvtier_server_request_duration_seconds", "Request latency",
                                 ["method"], registry=r, buckets=LATENCY_BUCKETS)
        self.bytes = Counter("kvtier_server_chunk_bytes_total", "Chunk bytes moved",
                             ["direction", "path"], registry=r)
        self.rejected = Counter("kvtier_server_rejected_chunks_total",
                                "Chunks refused by verification, by status", ["code"], registry=r)
        self.auth_failures = Counter("kvtier_server_auth_failures_total", "Requests refused by auth",
                                     ["code"], registry=r)
        self.data_connections = Gauge("kvtier_server_data_connections", "Open data-path connections",
                                      registry=r)
        if storage is not None:
            r.register(_StorageCollector(storage))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

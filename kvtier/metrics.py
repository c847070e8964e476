"""The library's Prometheus metrics (the store's), and the latency buckets every kvtier
histogram shares.

Three processes export kvtier metrics, and each declares its own in one place: the library
here (``kvtier_lookup_*``, ``kvtier_tier_*``, ``kvtier_store_*``, ...), kvtier-server in
``kvtier.server.metrics`` (``kvtier_server_*``) and the vLLM connector in
``kvtier_vllm.metrics`` (``kvtier_connector_*``, registered on this module's registry). All of
them take their histogram buckets from :data:`LATENCY_BUCKETS`.

Names follow ``kvtier_<subsystem>_<what>_<unit>`` (counters end ``_total``; the catalogue and
the rules, checked by tests/test_metric_names.py, are in docs/metrics.md). The ``tenant`` label
is capped (:mod:`kvtier.labelcap`: the first ``label_values`` tenants keep their name, later
ones read ``"other"``). Label values known up front (tiers, miss reasons) are declared when
the store is built, so dashboards read 0 rather than "no data". Each :class:`Metrics` owns its own
``CollectorRegistry`` so that several stores (tests, a server hosting many tenants) never
collide in the global registry; :meth:`Metrics.exposition` renders the text format without
any HTTP server running. Thread-safe (prometheus_client's own locking).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from kvtier.labelcap import DEFAULT_LIMIT, LabelCap
from kvtier.tiers import base as miss

# Seconds, from 100 us (a RAM lookup) to 10 s (a long restore from a slow tier).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Every reason a hit run stops or a chunk is refused (kvtier.tiers.base).
MISS_REASONS = (miss.ABSENT, miss.EVICTED, miss.EXPIRED, miss.CORRUPT, miss.TIMEOUT, miss.NODE_DOWN,
                miss.NAMESPACE_MISMATCH, miss.LAYOUT_MISMATCH, miss.TOO_LARGE, miss.ERROR)
# Every reason kvtier.chunk's decoder refuses a chunk with (ChunkError.reason).
CHUNK_ERROR_REASONS = ("truncated", "bad_magic", miss.CORRUPT, "bad_version", "unknown_codec",
                       "unknown_dtype", miss.LAYOUT_MISMATCH, miss.NAMESPACE_MISMATCH, "key_mismatch")
DROP_REASONS = ("rejected", "queue_full", "error", "closed")


class _Refresh(Collector):
    """Runs the registered refresh callbacks when the registry is scraped; yields nothing.

    Registered before every other collector of the registry, and prometheus_client collects
    in registration order, so gauges the callbacks set are current in the same scrape.
    Callbacks are held weakly (a store's bound method): a closed, dropped store stops counting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # scrapes may run concurrently with each other and add()
        self._callbacks: list[weakref.WeakMethod[Callable[[], Any]]] = []

    def add(self, callback: Callable[[], Any]) -> None:
        with self._lock:
            self._callbacks.append(weakref.WeakMethod(callback))  # type: ignore[arg-type]

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self._callbacks = [ref for ref in self._callbacks if ref() is not None]
            live = [fn for fn in (ref() for ref in self._callbacks) if fn is not None]
        for fn in live:
            fn()
        return iter(())


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, *,
                 label_values: int = DEFAULT_LIMIT) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.tenant_label = LabelCap(label_values)
        self._refresh = _Refresh()
        r.register(self._refresh)
        self.lookups = Counter("kvtier_lookup_requests_total", "Prefix lookups", ["tenant"], registry=r)
        self.hit_tokens = Counter(
            "kvtier_lookup_hit_tokens_total", "Prompt tokens found, by the tier that holds them",
            ["tier", "tenant"], registry=r)
        self.miss_tokens = Counter(
            "kvtier_lookup_miss_tokens_total", "Prompt tokens not found, by why the hit run stopped",
            ["reason", "tenant"], registry=r)
        self.hit_chunks = Counter(
            "kvtier_store_hit_chunks_total", "Chunks found by store lookups", ["tier"], registry=r)
        self.bytes_read = Counter(
            "kvtier_tier_read_bytes_total", "Chunk bytes read from a tier", ["tier"], registry=r)
        self.bytes_written = Counter(
            "kvtier_tier_written_bytes_total", "Chunk bytes written to a tier", ["tier"], registry=r)
        self.evictions = Counter(
            "kvtier_evictions_total", "Chunks evicted", ["tier", "reason"], registry=r)
        self.dropped_writes = Counter(
            "kvtier_store_dropped_writes_total", "Writes not performed", ["tier", "reason"], registry=r)
        self.chunk_errors = Counter(
            "kvtier_chunk_errors_total", "Chunks refused by the decoder", ["reason"], registry=r)
        for reason in CHUNK_ERROR_REASONS:
            self.chunk_errors.labels(reason)
        self.promotions = Counter(
            "kvtier_store_promoted_chunks_total", "Chunks copied up into a faster tier", ["tier"],
            registry=r)
        self.queue_depth = Gauge(
            "kvtier_store_queue_depth", "Batches waiting in the write-behind queue", registry=r)
        self.used_bytes = Gauge("kvtier_tier_used_bytes", "Bytes held by a tier", ["tier"], registry=r)
        self.capacity_bytes = Gauge(
            "kvtier_tier_capacity_bytes", "Byte capacity of a tier (0 = unbounded/unknown)", ["tier"],
            registry=r)
        self.entries = Gauge("kvtier_tier_entries", "Chunks held by a tier", ["tier"], registry=r)
        self.lookup_seconds = Histogram(
            "kvtier_lookup_duration_seconds", "Store lookup latency", registry=r, buckets=LATENCY_BUCKETS)
        self.load_seconds = Histogram(
            "kvtier_load_duration_seconds", "Store load latency", registry=r, buckets=LATENCY_BUCKETS)
        self.save_seconds = Histogram(
            "kvtier_save_duration_seconds", "Store write latency (first tier)", registry=r,
            buckets=LATENCY_BUCKETS)

    def on_scrape(self, callback: Callable[[], Any]) -> None:
        """Call the bound method ``callback`` at each scrape, before the series are read
        (held weakly: it stops when its object is gone). Runs on the scraping thread."""
        self._refresh.add(callback)

    def declare_tiers(self, tiers: tuple[str, ...]) -> None:
        """Create the per-tier series of ``tiers`` at 0 (bounded label values known up front)."""
        for name in tiers:
            self.hit_chunks.labels(name)
            self.bytes_read.labels(name)
            self.bytes_written.labels(name)
            self.promotions.labels(name)
            self.evictions.labels(name, "capacity")
            for reason in DROP_REASONS:
                self.dropped_writes.labels(name, reason)

    def declare_tenant(self, tenant: str, tiers: tuple[str, ...]) -> str:
        """Create a tenant's lookup series at 0; returns its (capped) label value."""
        label = self.tenant_label(tenant)
        self.lookups.labels(label)
        for name in tiers:
            self.hit_tokens.labels(name, label)
        for reason in MISS_REASONS:
            self.miss_tokens.labels(reason, label)
        return label

    def exposition(self) -> bytes:
        """Prometheus text format of every metric in this registry."""
        return generate_latest(self.registry)

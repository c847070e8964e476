"""The library's Prometheus metrics (the store's), and the latency buckets every kvtier
histogram shares.

Three processes export kvtier metrics, and each declares its own in one place: the library
here (``kvtier_lookup_*``, ``kvtier_tier_*``, ``kvtier_store_*``, ...), kvtier-server in
``kvtier.server.metrics`` (``kvtier_server_*``) and the vLLM connector in
``kvtier_vllm.stats`` (``kvtier_connector_*``, registered on this module's registry). All of
them take their histogram buckets from :data:`LATENCY_BUCKETS`.

Names follow ``kvtier_<subsystem>_<what>_<unit>``. Each :class:`Metrics` owns its own
``CollectorRegistry`` so that several stores (tests, a server hosting many tenants) never
collide in the global registry; :meth:`Metrics.exposition` renders the text format without
any HTTP server running. Thread-safe (prometheus_client's own locking).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds, from 100 us (a RAM lookup) to 10 s (a long restore from a slow tier).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
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

    def exposition(self) -> bytes:
        """Prometheus text format of every metric in this registry."""
        return generate_latest(self.registry)

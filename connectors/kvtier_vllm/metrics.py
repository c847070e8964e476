"""The vLLM connector's Prometheus series (``kvtier_connector_*``), on the store's registry.

Kept apart from ``stats`` (which subclasses vLLM's KVConnectorStats and so imports vLLM) so
that the series can be declared, checked against the naming rules (tests/test_metric_names.py)
and driven by a load generator without importing vLLM. Thread-safe (prometheus_client's locks).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from kvtier.metrics import LATENCY_BUCKETS, MISS_REASONS, Metrics


class ConnectorMetrics:
    """Connector series on the store's registry (``kvtier_connector_*``)."""

    def __init__(self, metrics: Metrics) -> None:
        r = metrics.registry
        self.load_tokens = Counter(
            "kvtier_connector_load_tokens_total", "Tokens restored into the engine, by tier",
            ["tier"], registry=r)
        self.load_failures = Counter(
            "kvtier_connector_load_failures_total",
            "Restores that fell short (blocks recomputed), by reason", ["reason"], registry=r)
        for reason in MISS_REASONS:  # declared up front: the panel reads 0, not "no data"
            self.load_failures.labels(reason)
        self.load_seconds = Histogram(
            "kvtier_connector_load_duration_seconds", "Time from load start to last layer restored",
            registry=r, buckets=LATENCY_BUCKETS)
        self.prefetch_wait_seconds = Histogram(
            "kvtier_connector_prefetch_wait_seconds",
            "Time the engine waited for a prefetch that had not finished", registry=r,
            buckets=LATENCY_BUCKETS)
        self.load_pageable_chunks = Counter(
            "kvtier_connector_load_pageable_chunks_total",
            "Chunks restored from pageable host memory (restore staging pool full, or a codec "
            "decompressed them)", registry=r)
        self.load_skipped_tokens = Counter(
            "kvtier_connector_load_skipped_tokens_total",
            "Hit tokens recomputed instead of loaded because loading them was estimated slower",
            registry=r)
        self.save_chunks = Counter(
            "kvtier_connector_saved_chunks_total", "Chunks handed to the store", registry=r)
        self.save_dropped = Counter(
            "kvtier_connector_dropped_save_jobs_total", "Save jobs dropped because the queue was full",
            registry=r)

    def declare_tiers(self, tiers: tuple[str, ...]) -> None:
        """Create the per-tier series at 0 once the store's tiers are known: a counter's first
        sample is invisible to ``rate()``, so a series born at its first restore would hide it."""
        for name in tiers:
            self.load_tokens.labels(name)

"""Observability: vLLM connector stats (logged by vLLM) and the connector's Prometheus metrics.

``KVTierStats`` travels from each worker (and the scheduler) to vLLM's stats logger every step
through ``get_kv_connector_stats``; vLLM aggregates the objects and calls ``reduce`` when it
logs. ``ConnectorMetrics`` (declared in ``kvtier_vllm.metrics``, which needs no vLLM) adds the
connector-level series to the store's own kvtier registry (``Metrics.registry``), so one
``/metrics`` endpoint shows store and connector together.
"""

from __future__ import annotations

import threading
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from .metrics import ConnectorMetrics

__all__ = ["ConnectorMetrics", "KVTierStats", "StatsCollector"]

_COUNTERS = ("lookups", "lookup_hit_tokens", "load_requests", "load_tokens", "load_bytes",
             "load_failed_tokens", "save_chunks", "save_bytes", "save_dropped", "prefetch_waits",
             "load_pageable_chunks", "kv_events", "kv_events_dropped", "load_skipped_tokens",
             "save_deduped_chunks")
_SECONDS = ("load_seconds", "save_seconds", "prefetch_wait_seconds")
_BY = ("hit_tokens_by_tier", "failures_by_reason")
# Block-granular hits (partial.py): lookup tokens past the full chunks, partial chunks saved.
_PARTIAL = ("partial_hit_tokens", "partial_save_chunks")


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in _COUNTERS}
    data.update({k: 0.0 for k in _SECONDS})
    data.update({k: 0 for k in _PARTIAL})
    data.update({k: {} for k in _BY})
    return data


class KVTierStats(KVConnectorStats):
    """Counters since the last collection; ``data`` is a plain (serialisable) dict."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data if data else _empty())

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in (*_COUNTERS, *_SECONDS, *_BY, *_PARTIAL))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, dict):
                mine = self.data.setdefault(k, {})
                for label, n in v.items():
                    mine[label] = mine.get(label, 0) + n
            elif isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, dict):
                for label, n in sorted(v.items()):
                    out[f"{k}[{label}]"] = n
            else:
                out[k] = round(v, 6) if isinstance(v, float) else v
        return out


class StatsCollector:
    """Thread-safe accumulator the connector halves write into; ``take`` drains it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data = _empty()
        self._dirty = False  # take() runs every engine step: make the empty case free

    def add(self, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self._data[k] = self._data.get(k, 0) + v
            self._dirty = True

    def add_by(self, key: str, label: str, n: float = 1) -> None:
        with self._lock:
            by = self._data.setdefault(key, {})
            by[label] = by.get(label, 0) + n
            self._dirty = True

    def take(self) -> KVTierStats | None:
        if not self._dirty:
            return None
        with self._lock:
            data, self._data, self._dirty = self._data, _empty(), False
        stats = KVTierStats(data)
        return None if stats.is_empty() else stats

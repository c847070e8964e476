"""Observability: vLLM connector stats (logged by vLLM) and the connector's Prometheus metrics.

``KVTierStats`` travels from each worker (and the scheduler) to vLLM's stats logger every step
through ``get_kv_connector_stats``; vLLM aggregates the objects and calls ``reduce`` when it
logs. ``aggregate`` serves two different sums and cannot tell them apart: vLLM's
``KVOutputAggregator`` folds the TP/PP workers' objects of one step into the first one's, the
scheduler folds its own in, and the API server's ``KVConnectorLogging`` folds the steps of a
log interval together. Every rank restores and saves the same requests, tokens and chunks
(each its own shard of their bytes), so a plain sum reads tokens, requests, chunks and
seconds N times too high at TP=N. Hence a worker's counters travel under its rank
(``data["ranks"][rank]``): ``aggregate`` sums per rank (steps add up, ranks stay apart), and
``reduce`` folds the ranks: bytes (``load_bytes``, ``save_bytes``, each rank's own shard) are
summed, every other worker figure takes the largest rank's value (the slowest rank's seconds,
any rank's failed tokens), then the flat counters (the scheduler's, and ``save_dropped``:
each rank's own queue's jobs) are added. ``ConnectorMetrics`` (declared in ``kvtier_vllm.metrics``, which needs no vLLM) adds the
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
# Per-rank figures that are each rank's own shard: summed over ranks (the rest: max over ranks).
_SHARD_SUMS = frozenset({"load_bytes", "save_bytes"})
_RANKS = "ranks"  # data[_RANKS][str(rank)]: a worker's counters (module docstring)
# Kept flat (summed over ranks): each rank's saver drops its own jobs from its own queue, and
# the scheduler's usage reporter reads it there (usage.py, on_worker_stats).
_FLAT_FROM_WORKERS = ("save_dropped",)


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = {k: 0 for k in _COUNTERS}
    data.update({k: 0.0 for k in _SECONDS})
    data.update({k: 0 for k in _PARTIAL})
    data.update({k: {} for k in _BY})
    return data


def _any(data: dict[str, Any]) -> bool:
    return any(data.get(k) for k in (*_COUNTERS, *_SECONDS, *_BY, *_PARTIAL))


def _add_into(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Sum ``other``'s counters (and labelled counters) into ``into``, copying, never aliasing."""
    for k, v in other.items():
        if isinstance(v, dict):
            mine = into.setdefault(k, {})
            for label, n in v.items():
                mine[label] = mine.get(label, 0) + n
        elif isinstance(v, (int, float)):
            into[k] = into.get(k, 0) + v


def _fold_ranks(ranks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One worker figure set from every rank's: shard bytes summed, the rest the max."""
    out: dict[str, Any] = {}
    for data in ranks.values():
        for k, v in data.items():
            if isinstance(v, dict):
                mine = out.setdefault(k, {})
                for label, n in v.items():
                    mine[label] = max(mine.get(label, 0), n)
            elif isinstance(v, (int, float)):
                out[k] = out.get(k, 0) + v if k in _SHARD_SUMS else max(out.get(k, 0), v)
    return out


class KVTierStats(KVConnectorStats):
    """Counters since the last collection; ``data`` is a plain (serialisable) dict: the
    scheduler's counters at the top level, each worker's under ``data["ranks"][rank]``."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=data if data else _empty())

    def reset(self) -> None:
        self.data = _empty()

    def is_empty(self) -> bool:
        return not _any(self.data) and not any(map(_any, self.data.get(_RANKS, {}).values()))

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        _add_into(self.data, {k: v for k, v in other.data.items() if k != _RANKS})
        ranks = self.data.setdefault(_RANKS, {})
        for rank, data in other.data.get(_RANKS, {}).items():
            _add_into(ranks.setdefault(rank, {}), data)
        return self

    def reduce(self) -> dict[str, int | float]:
        total: dict[str, Any] = {}
        _add_into(total, {k: v for k, v in self.data.items() if k != _RANKS})
        _add_into(total, _fold_ranks(self.data.get(_RANKS, {})))
        out: dict[str, int | float] = {}
        for k, v in total.items():
            if isinstance(v, dict):
                for label, n in sorted(v.items()):
                    out[f"{k}[{label}]"] = n
            else:
                out[k] = round(v, 6) if isinstance(v, float) else v
        return out


class StatsCollector:
    """Thread-safe accumulator the connector halves write into; ``take`` drains it. A
    worker's passes its ``rank``: its counters then travel under it (module docstring)."""

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
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
        if self.rank is not None:
            flat = {**_empty(), **{k: data.pop(k) for k in _FLAT_FROM_WORKERS if k in data}}
            data = {**flat, _RANKS: {str(self.rank): data}}
        stats = KVTierStats(data)
        return None if stats.is_empty() else stats

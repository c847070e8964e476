"""Counters of the SGLang backend, and SGLang's per-interval StorageMetrics.

``BackendStats`` counts pages and failures since the backend was built (``snapshot`` for logs,
tests and ``kvtier_stats``); ``take_interval`` hands SGLang's metrics collector the page counts
and bandwidths of the calls since the previous take, as SGLang's own backends do.
Threads: SGLang's prefetch and backup threads call in concurrently; one lock guards all.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class _Interval:
    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class BackendStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._interval = _Interval()

    def add(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] += n

    def read(self, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counts["pages_read"] += pages
            self._counts["bytes_read"] += nbytes
            if pages:
                self._interval.prefetch_pgs.append(pages)
                self._interval.prefetch_bandwidth.append(nbytes / max(seconds, 1e-9) / 1e9)

    def wrote(self, pages: int, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counts["pages_written"] += pages
            self._counts["bytes_written"] += nbytes
            if pages:
                self._interval.backup_pgs.append(pages)
                self._interval.backup_bandwidth.append(nbytes / max(seconds, 1e-9) / 1e9)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def take_interval(self) -> _Interval:
        with self._lock:
            out, self._interval = self._interval, _Interval()
            return out

"""Per-tenant accounting of kvtier-server's storage: the usage snapshot a tenant store reports
and the request-side traffic counters behind /api/stats and the cluster dashboard."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.tiers.base import Miss, TierUsage


@dataclass(frozen=True)
class TenantUsage:
    tenant: str
    used_bytes: int
    quota_bytes: int
    entries: int
    evictions: int
    tiers: tuple[TierUsage, ...]


class Traffic:
    """Request-side counters of one tenant store, for /api/stats and the cluster dashboard:
    chunk hits by the tier that served them and chunk misses by reason, separately for
    lookups (probes) and reads, plus chunk bytes stored and served. A lookup that stops at
    chunk i of n counts n - i misses under the reason the run stopped (as the library's
    ``kvtier_lookup_miss_tokens_total`` does). Thread-safe: one lock, a few adds a request."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.lookups = 0
        self.lookup_hits: Counter[str] = Counter()
        self.lookup_misses: Counter[str] = Counter()
        self.get_hits: Counter[str] = Counter()
        self.get_misses: Counter[str] = Counter()
        self.bytes_in = self.bytes_out = self.puts_refused = 0

    def lookup(self, hits: Counter[str], missed: int, reason: str) -> None:
        with self._lock:
            self.lookups += 1
            self.lookup_hits.update(hits)
            if missed:
                self.lookup_misses[reason] += missed

    def get(self, hits: Counter[str], misses: Iterable[Miss], nbytes: int) -> None:
        with self._lock:
            self.get_hits.update(hits)
            self.get_misses.update(m.reason for m in misses)
            self.bytes_out += nbytes

    def count_hits(self, tier: str, chunks: int, nbytes: int) -> None:
        """:meth:`get` of ``chunks`` hits (> 0), all in ``tier``, and no miss."""
        with self._lock:
            self.get_hits[tier] += chunks
            self.bytes_out += nbytes

    def put(self, stored_bytes: int, refused: int) -> None:
        with self._lock:
            self.bytes_in += stored_bytes
            self.puts_refused += refused

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "lookup": {"requests": self.lookups, "hit_chunks": dict(self.lookup_hits),
                           "miss_chunks": dict(self.lookup_misses)},
                "get": {"hit_chunks": dict(self.get_hits), "miss_chunks": dict(self.get_misses)},
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out, "puts_refused": self.puts_refused,
            }

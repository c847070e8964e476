"""Bounded label cardinality for Prometheus series: the first N distinct values keep their name.

Tenant and model names come from clients, so a label carrying them is unbounded: every new
tenant would add series to every scrape forever. :class:`LabelCap` maps a label value to
itself while fewer than ``limit`` distinct values have been seen, and every later value to
:data:`OTHER`; the set of kept values never changes once admitted, so a series never moves
between buckets. A real value equal to ``"other"`` shares the overflow bucket (documented
in docs/metrics.md). ``limit`` 0 sends everything to ``"other"``.

Thread-safe: one lock guards the admitted set (label lookups happen on request threads).
Memory: at most ``limit`` strings.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

OTHER = "other"
# Distinct tenant/model names kept per label before the rest share "other". Each kept value
# multiplies every series that carries the label, so this bounds a registry's size.
DEFAULT_LIMIT = 64


class LabelCap:
    """``cap(value)`` -> ``value`` for the first ``limit`` distinct values, else ``"other"``."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"label cap limit must be an integer >= 0, got {limit!r}")
        self.limit = limit
        self._kept: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: str) -> str:
        if not isinstance(value, str):
            raise TypeError(f"label value must be a str, got {type(value).__name__}")
        if value in self._kept:  # set membership is atomic under the GIL: the hot path takes no lock
            return value
        with self._lock:
            if value in self._kept:
                return value
            if len(self._kept) < self.limit:
                self._kept.add(value)
                return value
        return OTHER

    @property
    def kept(self) -> frozenset[str]:
        """The values that keep their own name (admitted so far)."""
        with self._lock:
            return frozenset(self._kept)

    def fold(self, values: Mapping[str, float] | Iterable[tuple[str, float]]) -> dict[str, float]:
        """Sum ``value -> n`` pairs by capped value: what a scrape-time collector emits so two
        overflowed names never produce the same label set twice."""
        pairs = values.items() if isinstance(values, Mapping) else values
        out: dict[str, float] = {}
        for value, n in pairs:
            key = self(value)
            out[key] = out.get(key, 0) + n
        return out

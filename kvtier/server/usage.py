"""What the engines report (``ReportUsage``), kept per replica with bounded memory.

Each report carries one engine component's CUMULATIVE counters (kvtier.usage.wire). Per key
``(tenant, model, replica, source)`` the aggregator keeps the last counters it saw and the sum of
the deltas between consecutive reports, so:

- a server restart loses nothing: the first report after it has no previous counters, and its
  whole cumulative value becomes the delta (the replica's totals come back in one report);
- a replica restart shows as a counter (or the replica's uptime) going down: the new value is
  then the delta (what the new process did so far), and ``restarts`` is counted;
- a time series of prompt and hit tokens per ``bucket_s`` bucket (the last ``buckets``) gives the
  hit ratio over time. A first report that is not the process's first (``seq`` > 1: this node
  just started, or just became reachable) goes to the totals only: those tokens were served
  earlier, and putting them in the current bucket would draw a false spike;
- a replica with no report for 3 of its own intervals is ``stale`` ("stopped reporting").

Caps (every name comes from outside): ``max_tenants`` and ``max_models`` distinct names, then
``other``; ``max_replicas`` keys, then a stale key is folded into its ``(tenant, model,
"other")`` entry to make room, or, when none is stale, the newcomer is counted there. Tenants
share the model and replica caps fairly: a tenant with fewer than ``cap // tenants`` of them
(tenants that reported so far) still gets its names when the cap is reached -- a new model is
then kept by name beyond ``max_models`` (a tenant adds at most ``max_models // 2`` past it:
the names stay bounded by the tenants, which the token file bounds), a new key takes the
place of the longest-silent key of the tenant holding the most. Without this, one tenant's
token could fill both caps with invented names (a few hundred reports) and every other
tenant's engines then showed, for the node's lifetime, as model ``other``. The last
counters of a key counted in ``other`` (folded, or a newcomer without room) are kept in an LRU
of ``max_tracked``, so that when it reports again -- into ``other`` or, room made, under its own
name -- only its delta is added (its earlier figures are already in ``other``). Per key, a
labelled counter (``hit_tokens/<tier>``, ``miss_tokens/<reason>``) keeps at most
:data:`MAX_LABELS` label values, the rest summed under ``<base>/other``: the client caps its
labels the same way, but a report's names come from outside, and without this a client that
sends new names in every report would grow the totals (and the ``/metrics`` series of
:mod:`kvtier.server.usage_metrics`) for ever. Histogram bounds and TTFT kinds the server knows
(:data:`kvtier.usage.counters.BUCKET_LABELS`, ``TTFT_KINDS``) do not count against the cap.

The same replica reporting to two nodes is two copies of one key; :mod:`kvtier.server.usage_view`
merges copies across nodes without adding them. Threads: one lock; every call is short.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.usage.counters import BUCKET_LABELS, MAX_LABELS, TTFT_KINDS, PrefixFigures
from kvtier.usage.wire import UsageReport

OTHER = "other"
STALE_INTERVALS = 3
MAX_USAGE_TENANTS = 64  # tenants kept by name when the caller does not say (UsageAggregator)
Key = tuple[str, str, str, str]  # tenant, model, replica, source
# Labels a labelled counter may carry beyond the MAX_LABELS cap: the ones the server reads.
_KNOWN_LABELS = {"restore_seconds_bucket": frozenset(BUCKET_LABELS),
                 "ttft_seconds_sum": frozenset(TTFT_KINDS), "ttft_seconds_count": frozenset(TTFT_KINDS)}


@dataclass
class ReplicaState:
    """One key's figures on this node (mutable, owned by the aggregator's lock)."""

    tenant: str
    model: str
    replica: str
    source: str
    first_seen: float
    last_seen: float = 0.0
    interval_s: float = 5.0
    uptime_s: float = 0.0
    reports: int = 0
    restarts: int = 0
    last: dict[str, float] = field(default_factory=dict)
    totals: dict[str, float] = field(default_factory=dict)
    series: dict[int, list[float]] = field(default_factory=dict)  # bucket -> [prompt, hit]
    top: tuple[PrefixFigures, ...] = ()


def hit_tokens(counters: Mapping[str, float]) -> float:
    return sum(v for k, v in counters.items() if k.startswith("hit_tokens/"))


def fold_counters(totals: dict[str, float], delta: Mapping[str, float]) -> None:
    """Add ``delta`` into ``totals``, a label past the first MAX_LABELS of its counter (known
    histogram bounds and TTFT kinds aside) going to ``<base>/other`` (see the module docstring)."""
    for name, v in delta.items():
        if name not in totals:
            base, sep, label = name.partition("/")
            if sep and label != OTHER and label not in _KNOWN_LABELS.get(base, ()):
                labels = sum(1 for k in totals if k.startswith(base + "/") and k != f"{base}/{OTHER}")
                if labels >= MAX_LABELS:
                    name = f"{base}/{OTHER}"
        totals[name] = totals.get(name, 0.0) + v


class UsageAggregator:
    def __init__(self, *, max_replicas: int = 256, max_models: int = 32, max_tenants: int = MAX_USAGE_TENANTS,
                 max_tracked: int = 4096, bucket_s: float = 10.0, buckets: int = 90,
                 clock: Callable[[], float] = time.time) -> None:
        self.max_replicas, self.max_models, self.max_tenants = max_replicas, max_models, max_tenants
        self.max_tracked, self.bucket_s, self.buckets = max_tracked, bucket_s, buckets
        self.clock = clock
        self._lock = threading.Lock()
        self._states: dict[Key, ReplicaState] = {}
        self._overflow_last: OrderedDict[Key, tuple[float, dict[str, float]]] = OrderedDict()
        self._models: set[str] = set()
        self._models_named: dict[str, int] = {}  # per tenant: model names it added to _models
        self._tenants: set[str] = set()
        self.reports = 0
        self.capped = 0  # reports counted under an "other" name

    def apply(self, tenant: str, report: UsageReport) -> None:
        """Fold one decoded report of ``tenant`` (from its credentials) into the figures."""
        now = self.clock()
        with self._lock:
            self.reports += 1
            tenant = self._capped_name(self._tenants, tenant, self.max_tenants)
            model = self._model_name(tenant, report.model)
            key: Key = (tenant, model, report.replica, report.source)
            state = self._states.get(key)
            if state is None and key[2] != OTHER and not self._make_room(tenant):
                self._apply_overflow(key, report, now)
                return
            prev: dict[str, float] | None = state.last if state is not None and state.reports else None
            prev_uptime = state.uptime_s if state is not None and state.reports else None
            if state is None:
                state = self._states[key] = ReplicaState(tenant, model, report.replica, report.source, now)
                # Counted in "other" before (folded, or no room then): what it reported up to
                # there is in "other" already, so only what came since is this key's.
                carried = self._overflow_last.pop(key, None)
                if carried is not None:
                    prev_uptime, prev = carried
            delta, recent = self._delta(prev, prev_uptime, report)
            if prev is not None and delta is report.counters:
                state.restarts += 1
            state.last = dict(report.counters)
            state.last_seen, state.interval_s, state.uptime_s = now, report.interval_s, report.uptime_s
            state.reports += 1
            state.top = report.top_prefixes
            self._add(state, delta, recent, now)

    def _delta(self, prev: dict[str, float] | None, prev_uptime: float | None,
               report: UsageReport) -> tuple[Mapping[str, float], bool]:
        """(delta, whether it happened within the last interval or two). The delta *is*
        ``report.counters`` exactly when there was nothing to subtract (first report or restart)."""
        cur = report.counters
        young = report.seq <= 1  # the process's first report: all of it happened just now
        if prev is None:
            return cur, young
        restarted = (prev_uptime is not None and report.uptime_s < prev_uptime) or \
            any(cur.get(k, 0.0) < v for k, v in prev.items())
        if restarted:
            return cur, young
        return {k: v - prev.get(k, 0.0) for k, v in cur.items() if v != prev.get(k, 0.0)}, True

    def _add(self, state: ReplicaState, delta: Mapping[str, float], recent: bool, now: float) -> None:
        fold_counters(state.totals, delta)
        prompt = delta.get("prompt_tokens", 0.0)
        if recent and prompt:
            cell = state.series.setdefault(int(now // self.bucket_s), [0.0, 0.0])
            cell[0] += prompt
            cell[1] += hit_tokens(delta)
            oldest = int(now // self.bucket_s) - self.buckets + 1
            for b in [b for b in state.series if b < oldest]:
                del state.series[b]

    def _capped_name(self, seen: set[str], name: str, cap: int) -> str:
        if name in seen:
            return name
        if len(seen) >= cap:
            self.capped += 1
            return OTHER
        seen.add(name)
        return name

    def _model_name(self, tenant: str, model: str) -> str:
        """``model``, or ``other`` past the cap; a tenant below its fair share of the cap
        (``max_models // tenants``) adds its name even past it (see the module docstring)."""
        if model in self._models:
            return model
        named = self._models_named.get(tenant, 0)
        tenants = len(self._tenants | {tenant})  # "other" (tenants past their cap) counts as one
        if len(self._models) >= self.max_models and named >= self.max_models // tenants:
            self.capped += 1
            return OTHER
        self._models.add(model)
        self._models_named[tenant] = named + 1
        return model

    def _make_room(self, tenant: str) -> bool:
        """True when one more key of ``tenant`` fits, folding the longest-silent stale key
        into its ``other`` entry if that is what it takes, else, when ``tenant`` holds fewer
        keys than its fair share (``max_replicas // tenants holding keys``), the
        longest-silent key of the tenant holding the most."""
        held = Counter(k[0] for k in self._states if k[2] != OTHER)
        if sum(held.values()) < self.max_replicas:
            return True
        now = self.clock()
        stale = [s for k, s in self._states.items() if k[2] != OTHER and self._is_stale(s, now)]
        if not stale:
            if held[tenant] >= self.max_replicas // len(held.keys() | {tenant}):
                return False
            biggest = max(held, key=lambda t: (held[t], t))
            stale = [s for k, s in self._states.items() if k[2] != OTHER and k[0] == biggest]
        victim = min(stale, key=lambda s: s.last_seen)
        victim_key: Key = (victim.tenant, victim.model, victim.replica, victim.source)
        del self._states[victim_key]
        self._remember(victim_key, victim.uptime_s, victim.last)
        other = self._other(victim.tenant, victim.model, now)
        fold_counters(other.totals, victim.totals)
        for b, (p, h) in victim.series.items():
            cell = other.series.setdefault(b, [0.0, 0.0])
            cell[0] += p
            cell[1] += h
        return True

    def _other(self, tenant: str, model: str, now: float) -> ReplicaState:
        key: Key = (tenant, model, OTHER, "*")
        if key not in self._states:
            self._states[key] = ReplicaState(tenant, model, OTHER, "*", now, last_seen=now)
        return self._states[key]

    def _apply_overflow(self, key: Key, report: UsageReport, now: float) -> None:
        self.capped += 1
        prev = self._overflow_last.pop(key, None)
        delta, recent = self._delta(prev[1] if prev else None, prev[0] if prev else None, report)
        self._remember(key, report.uptime_s, report.counters)
        other = self._other(key[0], key[1], now)
        other.last_seen = now
        other.reports += 1
        self._add(other, delta, recent, now)

    def _remember(self, key: Key, uptime_s: float, counters: Mapping[str, float]) -> None:
        """The last counters of ``key``, now counted in ``other`` (an LRU of max_tracked)."""
        self._overflow_last.pop(key, None)
        self._overflow_last[key] = (uptime_s, dict(counters))
        while len(self._overflow_last) > self.max_tracked:
            self._overflow_last.popitem(last=False)

    @staticmethod
    def _is_stale(state: ReplicaState, now: float) -> bool:
        return state.replica != OTHER and now - state.last_seen > STALE_INTERVALS * state.interval_s

    def document(self) -> dict[str, Any]:
        """The ``usage`` section of /api/stats: every key's figures (JSON-ready)."""
        now = self.clock()
        with self._lock:
            replicas = [{
                "tenant": s.tenant, "model": s.model, "replica": s.replica, "source": s.source,
                "first_seen": s.first_seen, "last_seen": s.last_seen, "age_s": round(now - s.last_seen, 3),
                "interval_s": s.interval_s, "stale": self._is_stale(s, now), "reports": s.reports,
                "restarts": s.restarts, "totals": dict(s.totals),
                "series": [[b, p, h] for b, (p, h) in sorted(s.series.items())],
                "top_prefixes": [[p.prefix, p.hit_tokens, p.restored_bytes] for p in s.top],
            } for s in self._states.values()]
            return {"now": now, "bucket_s": self.bucket_s, "buckets": self.buckets,
                    "reports": self.reports, "capped": self.capped, "replicas": replicas}

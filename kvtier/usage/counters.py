"""The cumulative usage counters of one engine component (a connector in one process).

A connector calls the ``record_*`` methods as requests go by; :meth:`UsageCounters.snapshot`
returns every counter as a flat ``name -> value`` map (what the wire carries). Names are a base
(:data:`SCALARS`, :data:`LABELLED`) optionally followed by ``/label``: ``hit_tokens/cpu``,
``miss_tokens/evicted``, ``restore_seconds_bucket/0.01``, ``ttft_seconds_sum/hit``.

Counters only ever grow within a process; the server turns them into deltas (a value that went
down means the process restarted). Besides the counters, a small space-saving table keeps the
prefixes (the first chunk's key, shortened) that served the most hit tokens: a snapshot of it
travels with each report as a gauge, not a counter.

Threads: every method takes one lock for a few dictionary updates; connectors call them from
their request threads, the reporter's thread takes snapshots.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.metrics import LATENCY_BUCKETS

# Plain counters (no label).
SCALARS = ("lookups", "prompt_tokens", "restored_tokens", "restored_bytes", "prefill_tokens_saved",
           "load_failures", "save_drops", "restore_seconds_sum", "restore_seconds_count")
# Counters with one label: tier, miss reason, histogram bound, or hit/miss (TTFT).
LABELLED = ("hit_tokens", "miss_tokens", "restore_seconds_bucket", "ttft_seconds_sum", "ttft_seconds_count")
TTFT_KINDS = ("hit", "miss")
MAX_LABELS = 16  # per labelled counter: tiers and miss reasons are a handful
TOP_PREFIXES = 8  # prefixes per report
_TABLE = 64  # space-saving table size (>= TOP_PREFIXES: the top ones are nearly exact)
PREFIX_HEX = 16  # hex characters of the first chunk key that name a prefix


def bucket_label(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


BUCKET_LABELS = tuple(bucket_label(b) for b in (*LATENCY_BUCKETS, math.inf))


@dataclass(frozen=True)
class PrefixFigures:
    """One prefix's figures since this process started (space-saving: may overcount a little)."""

    prefix: str
    hit_tokens: int
    restored_bytes: int


class UsageCounters:
    """Cumulative counters; see the module docstring. Labels beyond :data:`MAX_LABELS` per
    counter are counted under ``other``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = dict.fromkeys(SCALARS, 0)
        for b in BUCKET_LABELS:
            self._values[f"restore_seconds_bucket/{b}"] = 0
        self._labels: dict[str, set[str]] = {name: set() for name in LABELLED}
        self._prefixes: dict[str, list[int]] = {}  # prefix -> [hit_tokens, restored_bytes]

    # --- recording (connector threads) ------------------------------------------------------
    def record_lookup(self, prompt_tokens: int, hit_tokens: Mapping[str, int], miss_reason: str,
                      prefix: str = "") -> None:
        """One prompt looked up: ``hit_tokens`` per tier that holds them; the rest of the
        prompt (``prompt_tokens`` - hits) is counted as missed under ``miss_reason``."""
        hits = sum(max(0, int(v)) for v in hit_tokens.values())
        prompt = max(int(prompt_tokens), hits)
        with self._lock:
            self._add("lookups", 1)
            self._add("prompt_tokens", prompt)
            for tier, n in hit_tokens.items():
                if n > 0:
                    self._add_labelled("hit_tokens", tier, int(n))
            if prompt > hits:
                self._add_labelled("miss_tokens", miss_reason or "absent", prompt - hits)
            if prefix and hits:
                self._note_prefix(prefix[:PREFIX_HEX], hits, 0)

    def record_restore(self, tokens: int, seconds: float, nbytes: int = 0, prefix: str = "") -> None:
        """A restore that put ``tokens`` prompt tokens into the engine in ``seconds``."""
        with self._lock:
            self._add("restored_tokens", max(0, int(tokens)))
            self._add("restored_bytes", max(0, int(nbytes)))
            self._add("restore_seconds_sum", max(0.0, float(seconds)))
            self._add("restore_seconds_count", 1)
            for bound, label in zip((*LATENCY_BUCKETS, math.inf), BUCKET_LABELS):
                if seconds <= bound:
                    self._add(f"restore_seconds_bucket/{label}", 1)
            if prefix and nbytes:
                self._note_prefix(prefix[:PREFIX_HEX], 0, int(nbytes))

    def record_prefill_saved(self, tokens: int) -> None:
        """Prompt tokens the engine did not have to prefill thanks to the cache."""
        with self._lock:
            self._add("prefill_tokens_saved", max(0, int(tokens)))

    def record_load_failure(self, n: int = 1) -> None:
        with self._lock:
            self._add("load_failures", max(0, int(n)))

    def record_save_drop(self, n: int = 1) -> None:
        with self._lock:
            self._add("save_drops", max(0, int(n)))

    def record_ttft(self, hit: bool, seconds: float) -> None:
        """Time to first token of one request that did (``hit``) or did not restore a prefix."""
        kind = TTFT_KINDS[0] if hit else TTFT_KINDS[1]
        with self._lock:
            self._add_labelled("ttft_seconds_sum", kind, max(0.0, float(seconds)))
            self._add_labelled("ttft_seconds_count", kind, 1)

    # --- reading (reporter thread) ----------------------------------------------------------
    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def top_prefixes(self, n: int = TOP_PREFIXES) -> list[PrefixFigures]:
        with self._lock:
            items = sorted(self._prefixes.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))[:n]
        return [PrefixFigures(p, h, b) for p, (h, b) in items]

    # --- internals (lock held) --------------------------------------------------------------
    def _add(self, name: str, value: float) -> None:
        self._values[name] = self._values.get(name, 0) + value

    def _add_labelled(self, base: str, label: str, value: float) -> None:
        seen = self._labels[base]
        label = str(label)[:64] or "unknown"
        if label not in seen:
            if len(seen) >= MAX_LABELS - 1 and label != "other":
                label = "other"
            seen.add(label)
        self._add(f"{base}/{label}", value)

    def _note_prefix(self, prefix: str, hits: int, nbytes: int) -> None:
        entry = self._prefixes.get(prefix)
        if entry is None:
            if len(self._prefixes) >= _TABLE:
                # Space-saving: the smallest entry makes room and the newcomer inherits its
                # count, so a heavy prefix is never undercounted.
                victim = min(self._prefixes, key=lambda p: self._prefixes[p][0])
                floor = self._prefixes.pop(victim)
                entry = [floor[0], floor[1]]
            else:
                entry = [0, 0]
            self._prefixes[prefix] = entry
        entry[0] += hits
        entry[1] += nbytes

"""TieredStore: lookup / load / store across an ordered list of tiers (fastest first).

- lookup: the longest run of leading keys present in *some* tier, local tiers first; one
  probe per tier in the usual case (another pass only when a lower tier filled a gap).
- load: fetch that run, each chunk from the highest tier holding it; chunks served by a lower
  tier are promoted into the tiers above it (``promote_on_load``), before the load returns or,
  with ``load_into(..., defer_promotion=True)``, when the caller calls :meth:`promote`.
- store: write-through into tier 0 on the caller's thread (a memcpy for cpu), then cascade to
  the tiers below through a bounded queue served by one writer thread (kvtier.writebehind).
  When the queue is full the batch is dropped and counted: the caller (the engine) is never
  blocked. Write policies: ``write_through`` cascades every chunk; ``write_through_selective``
  only chunks loaded ``selective_min_hits`` times (to every tier below); ``write_back``
  cascades a chunk when tier i evicts it, with its depth and parent (writebehind.Lineage).
  A delete also cancels queued writes of its keys.

Threads: every public method may be called from any thread. ``close`` flushes the queue.
Failure: tiers never raise for medium failures (tiers/base.py), so neither does the store; a tier
that raises anyway costs the write-behind its batch (logged, counted `error`), never the thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from kvtier.codec import Buf
from kvtier.config import KVTierConfig, StoreConfig
from kvtier.metrics import Metrics
from kvtier.store_results import (
    Listeners,
    LoadIntoResult,
    LoadResult,
    LookupResult,
    Promotion,
    StoreListener,
)
from kvtier.tiers.base import (
    ABSENT,
    EVICTED,
    BoundedTier,
    Entry,
    Miss,
    PrefixOps,
    PrefixPlaced,
    Tier,
    TierUsage,
)
from kvtier.writebehind import Lineage, LoadCounts, WriteBehind, first_link

__all__ = ["LoadIntoResult", "LoadResult", "LookupResult", "Promotion", "StoreListener", "TieredStore"]

log = logging.getLogger(__name__)

# How a run-stopping reason ranks when tiers disagree: the most informative one wins.
_REASON_RANK = {ABSENT: 0, EVICTED: 1}


class TieredStore:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig | None = None,
                 metrics: Metrics | None = None) -> None:
        config = config if config is not None else StoreConfig()
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        self.metrics.declare_tiers(tuple(names))
        self.metrics.on_scrape(self._refresh_local_usage)
        self._load_counts = LoadCounts()
        self._listeners = Listeners()
        self._lineage = Lineage(names[:-1])  # write_back hands each chunk down with its parent
        if config.write_policy == "write_back":
            self._listeners.add(self._lineage)  # told of every put, before it runs
        for level, tier in enumerate(self.tiers):
            self._listen_to_evictions(level, tier)
        # Per-lookup constants, resolved once: isinstance against a runtime Protocol costs
        # ~10 us a tier, a labelled child ~1 us (issue 16's lookup budget).
        self._placed_ids = {id(t) for t in self.tiers if isinstance(t, PrefixPlaced)}
        self._hit_chunks = tuple(self.metrics.hit_chunks.labels(name) for name in names)
        self._behind = WriteBehind(len(self.tiers), config.queue_depth, self._write_one, self._remove_one,
                                   cascade=config.write_policy != "write_back", on_drop=self._dropped,
                                   on_depth=self.metrics.queue_depth.set)

    @classmethod
    def from_config(cls, cfg: KVTierConfig, metrics: Metrics | None = None) -> TieredStore:
        from kvtier.tiers.factory import build_tiers

        if metrics is None:
            metrics = Metrics(label_values=cfg.metrics_label_values)
        return cls(build_tiers(cfg), cfg.store, metrics)

    # --- lookup / load -------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes], prefix: Sequence[bytes] | None = None) -> LookupResult:
        """``prefix`` (here as in load, load_into and store): the keys of the whole prefix
        ``keys`` belong to, ``prefix[d]`` being chunk d; a prefix-placed tier (the grpc tier)
        then finds each chunk with its group. Callers that pass it must pass it to every verb."""
        t0 = time.perf_counter()
        n = len(keys)
        pos, runs, reason = 0, [], ABSENT
        progress = True
        bound = [self._verbs(t, prefix) for t in self.tiers]
        # Where each tier's last probe stopped: asking it again from there tells nothing new.
        stopped = [-1] * len(bound)
        while progress and pos < n:
            progress = False
            for level, verbs in enumerate(bound):
                if pos >= n:
                    break
                if stopped[level] == pos:
                    continue
                probe = verbs.probe(keys[pos:] if pos else keys)
                stopped[level] = pos + probe.hits
                if probe.hits:
                    runs.append((self.tiers[level].name, probe.hits))
                    self._hit_chunks[level].inc(probe.hits)
                    pos += probe.hits
                    progress = True
                    reason = ABSENT
                if pos < n and _REASON_RANK.get(probe.reason, 2) > _REASON_RANK.get(reason, 2):
                    reason = probe.reason
        self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
        return LookupResult(pos, tuple(runs), reason if pos < n else ABSENT)

    def _verbs(self, tier: Tier, prefix: Sequence[bytes] | None) -> Tier | PrefixOps:
        """:func:`bind_prefix` for one of this store's tiers, with the isinstance test made
        once in ``__init__`` (against a runtime Protocol it costs ~10 us a call)."""
        if prefix is not None and id(tier) in self._placed_ids:
            return tier.for_prefix(prefix)  # type: ignore[attr-defined]
        return tier

    def load(self, keys: Sequence[bytes], prefix: Sequence[bytes] | None = None) -> LoadResult:
        """The leading run of chunk bytes for ``keys`` (shorter when a chunk is missing)."""
        t0 = time.perf_counter()
        found: list[bytes | None] = [None] * len(keys)

        def fetch(tier: Tier, want: list[int]) -> list[int | Miss]:
            values = self._verbs(tier, prefix).get([keys[i] for i in want])
            for i, value in zip(want, values):
                if not isinstance(value, Miss):
                    found[i] = value
            return [v if isinstance(v, Miss) else len(v) for v in values]

        n, source, reason = self._cascade(len(keys), fetch)
        run = [c for c in found[:n] if c is not None]
        self.promote(Promotion(tuple(keys[:n]), tuple(run), tuple(source[:n]), prefix))
        self._after_load(keys, run, prefix)
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return LoadResult(run, [self.tiers[source[i]].name for i in range(n)], reason)

    def load_into(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                  prefix: Sequence[bytes] | None = None, *, defer_promotion: bool = False) -> LoadIntoResult:
        """:meth:`load` into caller-owned buffers, one per key, each large enough for its chunk
        (page-aligned buffers let the disk tier read straight into them with O_DIRECT): no
        per-chunk allocation. Promotion copies out of ``outs`` before returning, so the caller
        may reuse them as soon as this returns; with ``defer_promotion`` it is left to the
        caller (``result.promotion``, :meth:`promote`), off the path to the bytes it waits for."""
        if len(keys) != len(outs):
            raise ValueError(f"load_into got {len(keys)} keys and {len(outs)} buffers")
        t0 = time.perf_counter()
        sizes = [0] * len(keys)
        oversized: dict[int, bytes] = {}

        def fetch(tier: Tier, want: list[int]) -> list[int | Miss]:
            batch_keys = [keys[i] for i in want]
            try:
                results = self._verbs(tier, prefix).get_into(batch_keys, [outs[i] for i in want])
            except ValueError:
                # A stored chunk larger than the buffer sized for it is not a chunk of the
                # caller's layout (forged or foreign). Read the batch the allocating way and
                # hand it on as bytes: the caller's verification says what is wrong with it.
                values = self._verbs(tier, prefix).get(batch_keys)
                oversized.update((i, v) for i, v in zip(want, values) if not isinstance(v, Miss))
                results = [v if isinstance(v, Miss) else len(v) for v in values]
            for i, r in zip(want, results):
                if not isinstance(r, Miss):
                    sizes[i] = r
            return results

        n, source, reason = self._cascade(len(keys), fetch)
        run: list[Buf] = [oversized[i] if i in oversized else outs[i][: sizes[i]] for i in range(n)]
        pending = Promotion(tuple(keys[:n]), tuple(run), tuple(source[:n]), prefix)
        if not defer_promotion:
            self.promote(pending)
            pending = Promotion()
        self._after_load(keys, run, prefix)
        self.metrics.load_seconds.observe(time.perf_counter() - t0)
        return LoadIntoResult(run, [self.tiers[source[i]].name for i in range(n)], reason, pending)

    def _cascade(self, n: int, fetch: Callable[[Tier, list[int]], list[int | Miss]]
                 ) -> tuple[int, list[int], str]:
        """Ask each tier, top down, for the chunks no tier above it had (``fetch(tier,
        indexes)`` -> a size or a Miss per index). Returns the length of the leading run, the
        tier level that served each chunk, and why the run stopped."""
        source = [-1] * n
        reason = ABSENT
        for level, tier in enumerate(self.tiers):
            want = [i for i in range(n) if source[i] < 0]
            if not want:
                break
            for i, result in zip(want, fetch(tier, want)):
                if isinstance(result, Miss):
                    if _REASON_RANK.get(result.reason, 2) > _REASON_RANK.get(reason, 2):
                        reason = result.reason
                    continue
                source[i] = level
                self.metrics.bytes_read.labels(tier.name).inc(result)
        run = next((i for i, level in enumerate(source) if level < 0), n)
        return run, source, reason if run < n else ABSENT

    def promote(self, pending: Promotion, count: int | None = None) -> None:
        """Copy the first ``count`` (default: all) chunks of ``pending`` into the tiers above
        the one that served each, as ``promote_on_load`` asks. Any thread; the caller's
        buffers are free again when this returns."""
        if not self.config.promote_on_load:
            return
        n = len(pending.keys) if count is None else min(count, len(pending.keys))
        keys = pending.keys  # a run: chunk d0 + i extends chunk d0 + i - 1 (policies weigh it)
        d0, lead = first_link(keys, pending.prefix)
        for level in range(1, len(self.tiers)):
            served = [Entry(keys[i], pending.chunks[i], d0 + i, keys[i - 1] if i else lead)
                      for i in range(n) if pending.levels[i] == level]
            if not served:
                continue
            for upper in self.tiers[:level]:
                self._listeners.stored(upper.name, served)
                ok = self._verbs(upper, pending.prefix).put(served)
                self.metrics.promotions.labels(upper.name).inc(len(served))
                self._listeners.refused(upper.name, served, ok)

    def _after_load(self, keys: Sequence[bytes], run: Sequence[Buf], prefix: Sequence[bytes] | None) -> None:
        if self.config.write_policy == "write_through_selective" and len(self.tiers) > 1:
            due = self._load_counts.due(keys, run, prefix, self.config.selective_min_hits)
            if due:
                self._behind.enqueue(due, 1, prefix)

    # --- store ---------------------------------------------------------------------------
    @property
    def keeps_entries(self) -> bool:
        """Whether :meth:`store` keeps ``entry.data`` after it returns (the write-through
        cascade queues the entries for the tiers below). When False, every tier has copied or
        written the bytes by the time ``store`` returns (their puts are synchronous), so a
        caller may reuse its buffers then."""
        return len(self.tiers) > 1 and self.config.write_policy == "write_through"

    def store(self, entries: Sequence[Entry], prefix: Sequence[bytes] | None = None) -> int:
        """Write-through to tier 0 now, cascade below later. Takes ownership of ``entry.data``:
        the caller must not modify those buffers afterwards (unless :attr:`keeps_entries` is
        False: then only until this returns). Returns #chunks tier 0 accepted.
        ``prefix``: the keys of the prefix the entries belong to (``prefix[d]`` is chunk d), so
        that a prefix-placed tier puts each chunk where lookups of that prefix will ask."""
        if self._behind.closed:
            raise RuntimeError("TieredStore is closed")
        if not entries:
            return 0
        t0 = time.perf_counter()
        top = self.tiers[0]
        self._listeners.stored(top.name, entries)
        ok = self._verbs(top, prefix).put(entries)
        accepted = sum(ok)
        self.metrics.bytes_written.labels(top.name).inc(sum(_nbytes(e.data) for e, k in zip(entries, ok) if k))
        if accepted < len(entries):
            self.metrics.dropped_writes.labels(top.name, "rejected").inc(len(entries) - accepted)
        self._listeners.refused(top.name, entries, ok)
        self.metrics.save_seconds.observe(time.perf_counter() - t0)
        if len(self.tiers) > 1 and self.config.write_policy == "write_through":
            self._behind.enqueue(list(entries), 1, prefix)
        return accepted

    def _dropped(self, level: int, reason: str, n: int) -> None:
        self.metrics.dropped_writes.labels(self.tiers[level].name, reason).inc(n)

    def _write_one(self, level: int, entries: list[Entry], prefix: Sequence[bytes] | None) -> None:
        """The write-behind's put into one tier (on its thread)."""
        tier = self.tiers[level]
        self._listeners.stored(tier.name, entries)
        ok = self._verbs(tier, prefix).put(entries)
        self.metrics.bytes_written.labels(tier.name).inc(sum(_nbytes(e.data) for e, k in zip(entries, ok) if k))
        if not all(ok):
            self.metrics.dropped_writes.labels(tier.name, "rejected").inc(len(ok) - sum(ok))
        self._listeners.refused(tier.name, entries, ok)

    def _remove_one(self, level: int, keys: list[bytes], prefix: Sequence[bytes] | None) -> None:
        """The write-behind takes back keys a delete named while it was writing them (its thread)."""
        tier = self.tiers[level]
        if self._verbs(tier, prefix).delete(keys):
            self._listeners.removed(tier.name, keys)

    def _listen_to_evictions(self, level: int, tier: Tier) -> None:
        """Count evictions and tell the listeners; with ``write_back`` (and a tier below) also
        take the evicted bytes down. Only then does a tier hand the bytes over: a disk tier
        reads each victim's file for it, under its lock."""
        name = self.tiers[level].name
        counter = self.metrics.evictions.labels(name, "capacity")

        def evicted(key: bytes) -> None:
            counter.inc()
            self._listeners.removed(name, (key,))

        if self.config.write_policy == "write_back" and level + 1 < len(self.tiers):
            def write_back(key: bytes, data: bytes) -> None:
                evicted(key)
                if not self._behind.closed:
                    # The prefix is unknown here: a prefix-placed tier places the chunk by itself.
                    self._behind.enqueue([self._lineage.entry(key, data)], level + 1, None)

            tier.evict_listener = write_back
        else:
            tier.evicted_key_listener = evicted

    def delete(self, keys: Sequence[bytes], prefix: Sequence[bytes] | None = None) -> int:
        """Remove ``keys`` from every tier (e.g. a chunk that failed verification), and from the
        write-behind queue: a write of them queued before this call is not done. ``prefix`` as
        in :meth:`store`: without it a prefix-placed tier looks for each key on the nodes of
        the key alone, not of its group, and misses chunks stored with their prefix."""
        self._behind.forget(keys)
        total = 0
        for tier in self.tiers:
            n = self._verbs(tier, prefix).delete(keys)
            if n:
                self._listeners.removed(tier.name, keys)
            total += n
        return total

    # --- listeners -------------------------------------------------------------------------
    def listen(self, listener: StoreListener) -> None:
        """Tell ``listener`` from now on which tier took or lost which chunk (any thread)."""
        self._listeners.add(listener)

    @property
    def listener_errors(self) -> int:
        """Listener calls that raised (each logged with its traceback)."""
        return self._listeners.errors

    # --- lifecycle -----------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until the write-behind queue is empty; False if ``timeout_s`` passed first."""
        return self._behind.flush(timeout_s)

    def _refresh_local_usage(self) -> None:
        """At each scrape: the usage gauges of the tiers whose usage is local bookkeeping
        (BoundedTier: cpu, memory, disk). A remote tier's usage is a network call, so its
        gauges move only when :meth:`stats` is asked."""
        if self._behind.closed:
            return
        for tier in self.tiers:
            if isinstance(tier, BoundedTier):
                self._set_usage(tier)

    def _set_usage(self, tier: Tier) -> TierUsage:
        u = tier.usage()
        self.metrics.used_bytes.labels(tier.name).set(u.used_bytes)
        self.metrics.capacity_bytes.labels(tier.name).set(u.capacity_bytes)
        self.metrics.entries.labels(tier.name).set(u.entries)
        return u

    def stats(self) -> dict[str, dict[str, int]]:
        out = {}
        for tier in self.tiers:
            u = self._set_usage(tier)
            out[tier.name] = {"used_bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                              "entries": u.entries}
        return out

    @property
    def closed(self) -> bool:
        return self._behind.closed

    def close(self) -> None:
        """Write what is queued, then close the tiers (once, whichever thread calls first)."""
        if not self._behind.close():
            return
        for tier in self.tiers:
            tier.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _nbytes(data: Buf) -> int:
    """Bytes of a chunk buffer (``len`` of a memoryview counts elements, not bytes)."""
    return data.nbytes if isinstance(data, memoryview) else len(data)

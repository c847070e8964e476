"""The worker's answers to the scheduler's lookups (one per request and prefix start).

``LookupAnswerer.handle`` runs on the lookup server's threads (``ipc.LookupServer``): it finds
the leading full chunks the store holds, then (partial.py) the longest block-aligned partial
chunk right after them, and starts the prefetch of exactly what it answers, so the load that
follows usually finds its chunks in host memory already.

Reply: ``tokens`` (usable prefix end, block aligned, <= ``limit``), ``full`` (the part of it made
of full chunks), ``partial`` (end of the partial chunk included, 0 when none), ``tiers``
(chunks per tier), ``skipped`` (hit tokens left to recompute because loading them is slower,
loadplan.py), ``load_s`` (estimated load seconds), ``reason`` (why the full-chunk run stopped). Failure: store trouble is a
miss (the store never raises for it); a malformed request raises ValueError, which the server
turns into an error reply (a miss for the scheduler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.prefetch import Prefetcher

from .partial import probe_partial
from .restorebufs import RestoreBuffers
from .stats import StatsCollector

# (runs, start, full end) -> (end to load, tokens skipped for speed, chunks per tier, load seconds)
Decide = Callable[[Sequence[tuple[str, int]], int, int], tuple[int, int, dict[str, int], float]]


def prefetch_signature(salt: bytes, c0: int, end: int, partial: bool) -> tuple[object, ...]:
    """What a prefetch loaded: chunks from ``c0`` up to token ``end`` (``partial``: the last
    chunk is the partial one ending at ``end``; else ``end`` is a chunk boundary)."""
    return (salt, c0, end, partial)


def signature_covers(sig: tuple[object, ...], salt: bytes, c0: int, end: int, partial_end: int) -> bool:
    """True when a prefetch of signature ``sig`` holds what a load of ``[c0 * C, end)`` needs
    (with its trailing partial chunk ending at ``partial_end``, 0 for none)."""
    if len(sig) != 4 or sig[0] != salt or sig[1] != c0:
        return False
    got, got_partial = int(sig[2]), bool(sig[3])  # type: ignore[call-overload]
    if partial_end:
        return got_partial and got == partial_end
    return not got_partial and got >= end


class LookupAnswerer:
    def __init__(self, cache_for: Callable[[bytes], PrefixCache], chunk: int, block_size: int,
                 prefetcher: Prefetcher, restore_bufs: Callable[[], RestoreBuffers],
                 max_partial_probes: int, stats: StatsCollector,
                 on_lookup: Callable[[str, PrefixCache, np.ndarray, int, int], None] | None = None,
                 on_partial: Callable[[PrefixCache, np.ndarray, int], None] | None = None,
                 decide: Decide | None = None) -> None:
        """``restore_bufs`` returns the worker's current buffers (tests swap them).
        ``on_lookup(req_id, cache, tokens, c0, c1)`` runs before the lookup and its prefetch
        (KV events bind the request's chunk keys there, before a promotion can report them);
        ``on_partial(cache, tokens, end)`` before a found partial chunk is prefetched.
        ``decide(runs, start, full)``: load or recompute (loadplan.py) -> (end of the part to
        load, tokens skipped for speed, chunks per tier up to that end, estimated load seconds);
        a hit cut short for speed gets no partial chunk after it."""
        self.cache_for = cache_for
        self.chunk, self.block = chunk, block_size
        self.prefetcher = prefetcher
        self.restore_bufs = restore_bufs
        self.max_partial_probes = max_partial_probes
        self.stats = stats
        self.on_lookup, self.on_partial = on_lookup, on_partial
        self.decide = decide

    def handle(self, header: dict[str, Any], blob: bytes) -> dict[str, Any]:
        if header.get("op") != "lookup":
            raise ValueError(f"unknown op {header.get('op')!r}")
        tokens = np.frombuffer(blob, dtype="<u4")
        salt = bytes.fromhex(header["salt"])
        start, limit = int(header["start"]), int(header["limit"])
        if not 0 <= start <= limit <= len(tokens):
            raise ValueError(f"lookup: need 0 <= start {start} <= limit {limit} <= {len(tokens)} tokens")
        cache = self.cache_for(salt)
        c, bs = self.chunk, self.block
        if self.on_lookup is not None:
            self.on_lookup(str(header["req"]), cache, tokens, start // c, len(tokens) // c)
        hit = cache.lookup(tokens, full_chunks_only=True)
        full = min(hit.tokens, limit) // bs * bs
        tiers = dict(hit.per_tier)
        skipped, load_s = 0, 0.0
        if self.decide is not None:
            full, skipped, cut_tiers, load_s = self.decide(hit.runs, start, full)
            if skipped:
                tiers = cut_tiers
        partial = 0
        if not skipped and hit.tokens < limit and hit.tokens + bs <= limit:
            found = probe_partial(cache, tokens, hit.tokens, limit, bs, self.max_partial_probes)
            if found.end:
                partial = found.end
                if self.on_partial is not None:
                    self.on_partial(cache, tokens, partial)
                tiers[found.tier] = tiers.get(found.tier, 0) + 1
                self.stats.add(partial_hit_tokens=found.end - hit.tokens)
        usable = max(full, partial)
        if header.get("prefetch") and usable - start >= bs:
            c0 = start // c
            if partial:
                sig = prefetch_signature(salt, c0, partial, True)
                self.prefetcher.submit(str(header["req"]), sig,
                                       lambda: self.restore_bufs().load(cache, tokens[:partial], c0, 0, partial))
            else:
                c1 = -(-usable // c)
                sig = prefetch_signature(salt, c0, c1 * c, False)
                self.prefetcher.submit(str(header["req"]), sig,
                                       lambda: self.restore_bufs().load(cache, tokens[:c1 * c], c0, c1))
        return {"tokens": usable, "full": full, "partial": partial, "tiers": tiers, "skipped": skipped,
                "load_s": load_s, "reason": hit.reason}

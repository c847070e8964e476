"""Block-granular hits: a prefix's trailing block-aligned remainder as one partial chunk.

Full chunks (``chunk_tokens`` C) carry the bulk of a prefix; the engine's prefix cache works in
blocks (B tokens, C a multiple of B). Without more, a hit stops at the last full chunk and up
to C - B tokens of a shared prefix are recomputed. The key schema keys a trailing partial chunk
over its actual tokens (docs/keys.md): the partial chunk of ``p`` tokens at chunk index ``k``
is ``H(key_{k-1} || tokens[kC:kC+p])``. So:

save    the scheduler names, per request, block-aligned prefix ends that fall inside a chunk
        (the prompt's computed end, a local prefix-cache hit's end: ``partial_save_ends``); the
        worker stores tokens ``[kC, e)`` as one chunk under that key.
lookup  after the full-chunk run stops at chunk ``k``, probe the partial keys at ``k`` for the
        longest ``p`` (descending multiples of B, at most ``max_probes`` store lookups) and
        answer ``kC + p`` (``probe_partial``).
load    the full chunks and the partial one in one verified store read (``load_with_partial``).

A partial chunk never masks or corrupts a full chunk at the same position: its key hashes
fewer tokens, so it is a different key; full-chunk lookups and saves never compute it.
Pure functions over a ``PrefixCache``; threads: any (the store is thread-safe).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.keys import chunk_keys, chunk_spans
from kvtier.prefetch import LoadedRange, read_verified
from kvtier.tiers.base import PrefixPlaced


def is_partial_end(end: int, chunk: int, block: int) -> bool:
    """Whether a prefix ending at ``end`` can have a partial chunk: block aligned and inside a
    chunk (positive, not a multiple of ``chunk``)."""
    return end > 0 and end % block == 0 and end % chunk != 0


def partial_save_ends(candidates: Sequence[int], chunk: int, block: int, done: int) -> list[int]:
    """The prefix ends among ``candidates`` worth a partial chunk (``is_partial_end``) and
    computed (``<= done``); sorted, without repeats."""
    return sorted({e for e in candidates if e <= done and is_partial_end(e, chunk, block)})


def partial_candidates(full_end: int, limit: int, chunk: int, block: int, max_probes: int) -> list[int]:
    """Prefix ends to probe at the chunk that starts at ``full_end`` (where the full-chunk run
    stopped), longest first: ``full_end + p`` for p = B, 2B, ... below C, up to ``limit``."""
    if full_end % chunk or max_probes <= 0:
        return []
    top = min(limit - full_end, chunk - block) // block * block
    return [full_end + p for p in range(top, 0, -block)][:max_probes]


def partial_key(cache: PrefixCache, tokens: np.ndarray, end: int, parent: bytes | None = None) -> bytes:
    """The key of the partial chunk ``[end // C * C, end)`` of ``tokens``; ``parent`` is the key
    of the chunk before it (computed when not given; ignored for chunk 0)."""
    c = cache.chunk_tokens
    start = end // c * c
    if end <= start:
        raise ValueError(f"prefix end {end} is a chunk boundary (chunk_tokens {c}): no partial chunk")
    if start == 0:
        seed = cache.namespace
    elif parent is not None:
        seed = parent
    else:
        seed = cache.keys(tokens[:start], full_chunks_only=True)[-1]
    return chunk_keys(seed, tokens[start:end], c, cache.spec.hash_name)[0]


@dataclass(frozen=True)
class PartialHit:
    """The longest partial chunk found: tokens ``[end // C * C, end)`` in ``tier``; end 0: none."""

    end: int = 0
    tier: str = ""
    probes: int = 0


def probe_partial(cache: PrefixCache, tokens: np.ndarray, full_end: int, limit: int, block: int,
                  max_probes: int) -> PartialHit:
    """Probe the partial keys at ``full_end`` longest first; the first present one wins.

    The candidates are alternatives, not a chain, so the store's ``lookup`` (the leading run of
    a chain, with its metrics: ~20x a bare probe) does not fit; each tier's own ``probe`` is
    asked for one key at a time, fastest tier first (the store offers no batched "exists each"
    verb): a dict lookup on local tiers, one round trip on a remote one. At most ``max_probes``
    candidates; tiers answer trouble as a miss (``Probe``), never by raising.
    """
    cands = partial_candidates(full_end, limit, cache.chunk_tokens, block, max_probes)
    if not cands:
        return PartialHit()
    prefix = cache.keys(tokens[:full_end], full_chunks_only=True) if full_end else []
    parent = prefix[-1] if prefix else None
    # Which tiers place chunks by prefix, decided once: the runtime Protocol check inside
    # bind_prefix costs more than a local probe itself.
    tiers = [(t, isinstance(t, PrefixPlaced)) for t in cache.store.tiers]
    for i, end in enumerate(cands):
        key = partial_key(cache, tokens, end, parent)
        for tier, placed in tiers:
            verbs = tier.for_prefix([*prefix, key]) if placed else tier  # type: ignore[attr-defined]
            if verbs.probe([key]).hits:
                return PartialHit(end, tier.name, i + 1)
    return PartialHit(0, "", len(cands))


def load_with_partial(cache: PrefixCache, tokens: np.ndarray, start_chunk: int, end: int,
                      outs: Sequence[memoryview] | None = None, buffers: object = None) -> LoadedRange:
    """Load and verify chunks ``start_chunk ..`` of ``tokens[:end]``: the full chunks, then the
    partial chunk ``[end // C * C, end)`` (``end`` must not be a chunk boundary), in one store
    read. ``outs``/``buffers`` as in ``kvtier.prefetch.load_range``; never raises for store
    trouble (a missing or bad chunk ends the run, a bad one is deleted)."""
    t0 = time.perf_counter()
    c = cache.chunk_tokens
    if end % c == 0 or end > len(tokens):
        raise ValueError(f"load_with_partial: end {end} must be inside a chunk of {c} and within "
                         f"the {len(tokens)} tokens given")
    prefix = cache.keys(tokens[:end])  # full chunks, then the partial one
    spans = chunk_spans(end, c)[start_chunk:]
    if outs is not None and len(outs) != len(spans):
        raise ValueError(f"load_with_partial got {len(outs)} buffers for {len(spans)} chunks")
    return read_verified(cache, prefix, start_chunk, spans, outs, buffers, t0)


def chunk_tokens_at(index: int, chunk: int, partial_end: int) -> int:
    """Tokens in chunk ``index`` of a load whose last chunk is partial at ``partial_end`` (0: none)."""
    if partial_end and index == partial_end // chunk:
        return partial_end - index * chunk
    return chunk


def agree_on_hit(replies: list[dict[str, Any]], limit: int, chunk: int) -> tuple[int, int]:
    """(usable tokens, partial chunk end or 0) every rank's lookup reply agrees on: a prefix
    counts only if every rank holds its shard of it, and a partial chunk only if every rank
    found the same one right after the same full chunks. No replies: a miss."""
    if not replies:
        return 0, 0
    full = min(limit, *(int(r.get("full", r.get("tokens", 0))) for r in replies))
    ends = {int(r.get("partial", 0)) for r in replies}
    (pe,) = ends if len(ends) == 1 else (0,)
    if pe and full == pe // chunk * chunk:
        return min(limit, pe), pe
    return full, 0

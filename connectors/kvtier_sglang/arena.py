"""Pages straight between SGLang's host pool and an in-process cpu tier's arena: one copy each way.

Why: through the store, a page read is copied arena -> chunk buffer, verified, then copied
buffer -> host pool; a page write is copied pool -> chunk buffer, framed, then buffer -> arena.
Every copy is a full pass over the page through DRAM, the bulk of an L3 transfer's CPU time.
When the store's first tier is kvtier's ``CpuTier`` (same process):

- read: ``CpuTier.leased`` gives a read-only view of the chunk in the arena that no eviction,
  delete or overwrite can reuse while held; the chunk is verified there (header, namespace, key,
  shape, payload checksum) and copied once into the pool. The first page the cpu tier lacks
  ends this path; the caller reads the rest through the store (lower tiers, promotion).
- write (single-tier stores only: a write-through cascade needs the chunk bytes for the lower
  tiers anyway): ``CpuTier.put_in_place`` hands the slot; the page is copied from the pool into
  it and the chunk framed around it there (header + xxh3 checksum).

Failure: a chunk that fails verification is counted (``chunk_errors``), deleted from every tier
and ends the run, as ``PrefixCache.load_verified`` does; nothing wrong reaches the pool. A page
the tier refuses (no slot) is a ``False`` for the caller.
Threads: any (leases and slots are per call; host regions of concurrent calls are disjoint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from kvtier.cache import PrefixCache
from kvtier.chunk import HEADER_SIZE, decode_chunk, frame_raw_chunk
from kvtier.codec import Codec
from kvtier.errors import ChunkError
from kvtier.tiers.base import Miss
from kvtier.tiers.cpu import CpuTier

from .pages import load_page, page_nbytes, save_page_hashed

log = logging.getLogger(__name__)

PageView = Callable[[int], torch.Tensor]  # page i -> its view in canonical order (pages.page_view)


TierT = TypeVar("TierT")


def first_tier_of(cache: PrefixCache, kind: type[TierT]) -> TierT | None:
    """The store's first tier when it is a ``kind`` (whose chunks can be read where they lie)."""
    tiers = cache.store.tiers
    return tiers[0] if tiers and isinstance(tiers[0], kind) else None


def only_raw_tier_of(cache: PrefixCache, kind: type[TierT]) -> TierT | None:
    """The store's only tier when it is a ``kind`` and chunks are raw, so a page can be framed
    in place (no cascade to a lower tier, no codec between the page and the stored bytes)."""
    raw = cache.codec == Codec.RAW and not cache.shuffle
    return first_tier_of(cache, kind) if raw and len(cache.store.tiers) == 1 else None


def leasing_tier(cache: PrefixCache) -> CpuTier | None:
    """The store's first tier when it is a cpu tier whose chunks can be read in place."""
    return first_tier_of(cache, CpuTier)


def writable_tier(cache: PrefixCache) -> CpuTier | None:
    """The store's only tier when it is a cpu tier raw chunks can be framed in (no cascade)."""
    return only_raw_tier_of(cache, CpuTier)


def read_leased(cache: PrefixCache, tier: CpuTier, keys: Sequence[bytes], page_tokens: int,
                dst_for: PageView) -> int:
    """Copy the verified chunks of the leading ``keys`` the cpu tier holds into ``dst_for(i)``;
    returns how many."""
    shape = cache.spec.layout.chunk_shape(page_tokens)
    dtype, namespace = cache.spec.kv_dtype, cache.namespace
    read = cache.store.metrics.bytes_read.labels(tier.name)
    for i, key in enumerate(keys):
        with tier.leased(key) as view:
            if isinstance(view, Miss):
                return i
            try:
                chunk = decode_chunk(view, namespace=namespace, key=key, dtype=dtype, shape=shape)
            except ChunkError as exc:
                log.warning("refusing chunk %d (%s): %s", i, key.hex()[:16], exc)
                cache.metrics.chunk_errors.labels(exc.reason).inc()
                bad = True
            else:
                load_page(dst_for(i), chunk.payload)
                read.inc(view.nbytes)
                bad = False
        if bad:
            cache.store.delete([key])
            return i
    return len(keys)


def page_framer(cache: PrefixCache, key: bytes, src: torch.Tensor, page_tokens: int, *,
                streaming: bool = True) -> Callable[[memoryview], None]:
    """``fill(dst)``: the raw chunk of page ``src`` under ``key``, built in ``dst`` (exactly
    ``HEADER_SIZE + page_nbytes(src)`` bytes): the page copied behind the header, then framed
    there. ``streaming``: see :func:`kvtier.strided.gather_into` (True for a cache's slot)."""
    shape = cache.spec.layout.chunk_shape(page_tokens)
    dtype, namespace = cache.spec.kv_dtype, cache.namespace

    def fill(dst: memoryview) -> None:
        digest = save_page_hashed(src, dst[HEADER_SIZE:], streaming=streaming)
        frame_raw_chunk(dst, namespace, key, dtype, shape, payload_xxh3=digest)

    return fill


def write_in_place(cache: PrefixCache, tier: CpuTier, keys: Sequence[bytes], page_tokens: int,
                   src_for: PageView, depth0: int, parent0: bytes) -> int:
    """Store page ``i`` (``src_for(i)``) under ``keys[i]`` straight into the arena; ``keys[i]``
    sits at prefix depth ``depth0 + i`` under ``keys[i - 1]`` (``parent0`` for the first).
    Returns how many the tier accepted (it stops at the first refusal)."""
    metrics = cache.store.metrics
    for i, key in enumerate(keys):
        src = src_for(i)
        length = HEADER_SIZE + page_nbytes(src)
        if not tier.put_in_place(key, length, page_framer(cache, key, src, page_tokens),
                                 depth0 + i, keys[i - 1] if i else parent0):
            metrics.dropped_writes.labels(tier.name, "rejected").inc(len(keys) - i)
            return i
        metrics.bytes_written.labels(tier.name).inc(length)
    return len(keys)

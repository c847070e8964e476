"""Pages straight between SGLang's host pool and a kvtier-server's shared segment: one copy on
this side each way.

Why: through the store, a page read from a kvtier-server on this host is copied out of the data
connection's shared segment into a chunk buffer, verified there, then copied into the host pool;
a page write is copied from the pool into a chunk buffer, framed, then copied into the segment.
Each copy is a full pass over the page through DRAM. When the store's first tier is the grpc
tier (kvtier-server nodes):

- read: ``GrpcTier.get_visit`` hands each chunk to us where it lies (on the shared-memory data
  path: in the segment); it is verified there (header, namespace, key, shape, payload checksum)
  and copied once into the pool. Off shared memory the chunk lies in bytes the data path read.

- write (single-tier stores only, raw codec: as arena.py's): ``GrpcTier.put_filled`` has each
  page copied from the pool straight into the segment and framed there, its reference sent at
  once, so the server verifies and stores page i while page i+1 is copied.

Placement: ``get_visit`` and ``put_filled`` place every key by itself (they take no prefix).
On a cluster where a prefix places pages by their group (several nodes, ``group_chunks`` > 1;
prefix.py) they would ask other nodes than the store's prefix-placed verbs, so the backend uses
them only where ``places_alike`` says both reach the same nodes (one node, one chunk per group,
no prefix known, or a batch that happens to agree); otherwise pages go through the store.

Failure: a chunk that fails verification is counted (``chunk_errors``), deleted from every tier
and ends the run, as ``PrefixCache.load_verified`` does; nothing unverified reaches the pool (a
page is copied only after its chunk verified). A miss ends the run too.
Threads: any; the tier may visit pages of different nodes from its own threads (each page's
host region is its own, and the bookkeeping below is per call).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.cache import PrefixCache
from kvtier.chunk import HEADER_SIZE, decode_chunk
from kvtier.errors import ChunkError
from kvtier.tiers.base import FilledEntry, Miss
from kvtier.tiers.remote.tier import GrpcTier

from .arena import PageView, first_tier_of, only_raw_tier_of, page_framer
from .pages import load_page, page_nbytes

log = logging.getLogger(__name__)


def remote_tier(cache: PrefixCache) -> GrpcTier | None:
    """The store's first tier when it is a grpc tier (chunks can be read where they lie)."""
    return first_tier_of(cache, GrpcTier)


def filling_tier(cache: PrefixCache) -> GrpcTier | None:
    """The store's only tier when it is a grpc tier raw chunks can be framed in (no cascade)."""
    return only_raw_tier_of(cache, GrpcTier)


def places_alike(tier: GrpcTier, keys: Sequence[bytes], prefix: Sequence[bytes] | None) -> bool:
    """Whether the per-key verbs reach, for every one of ``keys``, the replicas (in order) the
    prefix-placed verbs for ``prefix`` (``keys`` a run of it) would."""
    if prefix is None or tier.config.group_chunks == 1:
        return True
    return tier.placement(keys) == tier.placement(keys, prefix)


def read_visited(cache: PrefixCache, tier: GrpcTier, keys: Sequence[bytes], page_tokens: int,
                 dst_for: PageView) -> int:
    """Copy the verified chunks of the leading ``keys`` the grpc tier holds into
    ``dst_for(i)``; returns how many."""
    shape = cache.spec.layout.chunk_shape(page_tokens)
    dtype, namespace = cache.spec.kv_dtype, cache.namespace
    copied = [False] * len(keys)
    refused: dict[int, ChunkError] = {}

    def visit(i: int, view: memoryview) -> None:
        try:
            chunk = decode_chunk(view, namespace=namespace, key=keys[i], dtype=dtype, shape=shape)
        except ChunkError as exc:
            refused[i] = exc
            return
        load_page(dst_for(i), chunk.payload)
        copied[i] = True

    results = tier.get_visit(keys, visit)
    n, nbytes = 0, 0
    for i, result in enumerate(results):
        if isinstance(result, Miss) or not copied[i] or i in refused:
            break
        n, nbytes = i + 1, nbytes + result
    cache.store.metrics.bytes_read.labels(tier.name).inc(nbytes)
    if n < len(keys) and n in refused:
        exc = refused[n]
        log.warning("refusing chunk %d (%s): %s", n, keys[n].hex()[:16], exc)
        cache.metrics.chunk_errors.labels(exc.reason).inc()
        cache.store.delete([keys[n]])
    return n


def write_filled(cache: PrefixCache, tier: GrpcTier, keys: Sequence[bytes], page_tokens: int,
                 src_for: PageView, depth0: int, parent0: bytes) -> list[bool]:
    """Store page ``i`` (``src_for(i)``) under ``keys[i]``, framed where the data path sends it
    from; ``keys[i]`` sits at prefix depth ``depth0 + i`` under ``keys[i - 1]`` (``parent0``
    for the first). Per page whether the tier stored it."""
    items = []
    for i, key in enumerate(keys):
        src = src_for(i)
        # The server reads the page as soon as it is sent: ordinary stores leave it in cache.
        fill = page_framer(cache, key, src, page_tokens, streaming=False)
        items.append(FilledEntry(key, HEADER_SIZE + page_nbytes(src), fill, depth0 + i,
                                 keys[i - 1] if i else parent0))
    stored = tier.put_filled(items)
    metrics = cache.store.metrics
    metrics.bytes_written.labels(tier.name).inc(sum(i.length for i, ok in zip(items, stored) if ok))
    if not all(stored):
        metrics.dropped_writes.labels(tier.name, "rejected").inc(stored.count(False))
    return stored

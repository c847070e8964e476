"""Zero-copy page reads from an in-process cpu tier: verify the chunk where it lies, copy once.

Why: a page read through ``TieredStore.load_into`` is copied arena -> chunk buffer, verified,
then copied buffer -> host pool: two full passes over the page plus the checksum pass. When the
store's first tier is kvtier's ``CpuTier`` (same process), ``CpuTier.leased`` gives a read-only
view of the chunk in the arena that no eviction, delete or overwrite can reuse while held, so
the chunk is verified there (header, namespace, key, shape, payload checksum) and copied
straight into the host pool: one copy. The first page the cpu tier lacks ends this fast path;
the caller reads the rest through the store (lower tiers, promotion) as before.

Failure: a chunk that fails verification is counted (``chunk_errors``), deleted from every tier
and ends the run, exactly as ``PrefixCache.load_verified`` does; nothing wrong reaches the pool.
Threads: any (leases are per call; the host regions of concurrent calls are disjoint).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.chunk import decode_chunk
from kvtier.errors import ChunkError
from kvtier.tiers.base import Miss
from kvtier.tiers.cpu import CpuTier

log = logging.getLogger(__name__)


def leasing_tier(cache: PrefixCache) -> CpuTier | None:
    """The store's first tier when it is a cpu tier whose chunks can be read in place."""
    tiers = cache.store.tiers
    return tiers[0] if tiers and isinstance(tiers[0], CpuTier) else None


def read_leased(cache: PrefixCache, tier: CpuTier, keys: Sequence[bytes], page_tokens: int,
                dst_for: Callable[[int], np.ndarray]) -> int:
    """Copy the verified chunks of the leading ``keys`` the cpu tier holds into
    ``dst_for(i)`` (a writable uint8 view of page i's canonical bytes); returns how many."""
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
                dst = dst_for(i)
                np.copyto(dst, np.frombuffer(chunk.payload, np.uint8).reshape(dst.shape))
                read.inc(view.nbytes)
                bad = False
        if bad:
            cache.store.delete([key])
            return i
    return len(keys)

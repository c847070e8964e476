"""Restore a cached prefix into a transformers cache with one copy per byte, reads overlapped.

The chunk layout is ``(layers, kv=2, tokens, kv_heads, head_dim)``; transformers keeps per layer
``(1, kv_heads, seq, head_dim)``. The path, per batch of chunks:

1. the store reads the chunks straight into the connector's staging buffers
   (:class:`~kvtier_hf.staging.StagingRing`: page-aligned, pre-faulted once, reused;
   :meth:`~kvtier.cache.PrefixCache.load_verified_into`: O_DIRECT into place on disk, no
   per-chunk ``bytes``), verifying every chunk as :meth:`PrefixCache.load` does;
2. meanwhile ``READS_IN_FLIGHT`` reader threads read ahead, up to one batch less than the
   ring holds, while the main thread copies finished batches, token axis and head axis
   swapped, straight into per-layer K and V tensors preallocated for the whole prefix;
3. the tensors are installed in the cache as they are (:func:`~kvtier_hf.compat.set_layer_kv`),
   without the ``torch.cat`` that ``DynamicCache.update`` would do.

Promotion (``promote_on_load``: the chunks read from the disk tier are copied up into the cpu
tier) is deferred out of the readers: the copier thread promotes each batch once it is copied
into K/V, before its staging set is read into again (``defer_promotion``). Done by the readers,
it held each read up by one more 2 MiB copy, and the restore, bound by the reads here, ran at
0.75-0.78x the disk's read against 0.90-0.96x with promotion off (``kvtier demo``, 3 runs
each, 2026-12-05).

Why reads run ahead of the copy: the KV tensors are fresh memory, and faulting their pages in
costs about as much as the copy itself (~0.5 ms per 2 MiB chunk each on a 2-core VM). Before,
only ``READS_IN_FLIGHT`` batches were ever submitted ahead and the main thread faulted the
whole output in before taking the first batch, so the disk sat idle for that long (26 ms of an
81 ms restore of 51 MB); now the reads keep going whatever the copy does, and each copy
faults in only the pages it writes (measured: a restore in a fresh process at 0.97-1.08 GB/s
against 0.68-0.98 GB/s with the up-front pass kept, the disk reading ~1 GB/s). Several reader
threads, not one, so that one chunk's verification overlaps the next chunk's read (a single
thread left a ~0.9 GB/s disk idle ~20% of the time); four, the read limit's own depth, since
a faster disk (1.7-2.2 GB/s, 2026-12-06) streams more with more reads queued: restore pairs
at 1.6-2.0 GB/s with four against 1.3-1.5 with two. The KV tensors
come from :func:`~kvtier_hf.kv.fresh_kv`, which faults in transparent huge pages where the
kernel offers them: `kvtier demo`'s restore went from 1.18-1.40 to 1.46-1.70 GB/s with it
(3 runs each, 2026-12-05), its first restore from 0.60-0.64x to 0.81-0.87x the disk's read.
A connector passes its :class:`~kvtier_hf.kvpool.KVPool`, so that after its first restore
the K/V tensors come from memory an earlier restore used and transformers let go of: on a VM
fresh memory is also faulted in by the host, and the copy into it took 3-6x as long, run to
run (see kvtier_hf/kvpool.py).

The copy uses numpy, which releases the GIL while it copies: K on the calling thread, V on
one copier thread. torch's parallel copy fights the reader threads for the cores and, on a busy
2-core host, ran 5-10x slower than a plain strided memcpy; two numpy copies side by side do
not (50 MiB of chunks into fresh K/V: 3.2 ms against 4.7 ms on one thread; in ``kvtier demo``
the restore's copy time fell from 109 to 76-94 ms over its six restores, 2026-12-05).

Threads: ``READS_IN_FLIGHT`` reader threads and one copier thread per call, joined before
returning; one restore at a time per staging ring (its lock). Failure: as ``PrefixCache``: a
missing or refused chunk ends the restored prefix (never an exception for store trouble).
"""

from __future__ import annotations

import math
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.cache import PrefixCache, VerifiedRun
from kvtier.chunk import HEADER_SIZE, PAGE, dtype_itemsize
from kvtier.keys import chunk_spans
from kvtier.tiers.base import ABSENT
from kvtier_hf.compat import new_cache, set_layer_kv
from kvtier_hf.kv import Devices, fresh_kv, layer_device
from kvtier_hf.kvpool import KVPool
from kvtier_hf.staging import StagingRing

BATCH_BYTES = 4 << 20  # chunks per read batch, by bytes: big enough to stream, small to overlap
STAGING_BYTES = 20 << 20  # a connector's staging ring, by bytes (within MIN_SETS..MAX_SETS sets)
READS_IN_FLIGHT = 4  # reader threads: the disk's depth (as read_limit.READ_DEPTH), and verification overlaps reads
MIN_SETS, MAX_SETS = READS_IN_FLIGHT + 1, 8  # reads in flight + the batch being copied; more buy nothing
# Copy bits, not values (numpy has no bfloat16): an integer view of the element size.
_BITS: dict[int, tuple[Any, torch.dtype]] = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16),
                                             4: (np.int32, torch.int32), 8: (np.int64, torch.int64)}


@dataclass(frozen=True)
class Restored:
    cache: Any
    tokens: int
    per_tier: dict[str, int]
    reason: str
    nbytes: int  # encoded chunk bytes read from the store


def buffer_bytes(prefix_cache: PrefixCache) -> int:
    """Room for one chunk of this namespace, encoded with any codec (lz4 and zstd can grow
    incompressible data by ~1/255), rounded to whole pages."""
    lay = prefix_cache.spec.layout
    raw = math.prod(lay.chunk_shape(lay.chunk_tokens)) * dtype_itemsize(prefix_cache.spec.kv_dtype)
    return -(-(HEADER_SIZE + raw + raw // 255 + 64) // PAGE) * PAGE


def staging_for(prefix_cache: PrefixCache) -> StagingRing:
    """A staging ring for ``prefix_cache``'s chunks: batches of about BATCH_BYTES, the ring
    about STAGING_BYTES. Allocates and pre-faults it now (build it once, keep it)."""
    size = buffer_bytes(prefix_cache)
    batch = max(1, BATCH_BYTES // size)
    return StagingRing(size, batch, min(MAX_SETS, max(MIN_SETS, STAGING_BYTES // (size * batch))))


def restore(prefix_cache: PrefixCache, ids: np.ndarray, hit_tokens: int, use_tokens: int,
            dtype: torch.dtype, config: Any = None, device: Devices = "cpu",
            staging: StagingRing | None = None, kv_pool: KVPool | None = None) -> Restored:
    """Load up to ``use_tokens`` tokens of the ``hit_tokens``-token cached prefix of ``ids``
    into a new cache (fewer when a chunk is missing or refused). ``staging``: the caller's
    ring (see :func:`staging_for`; its buffers must fit one chunk of ``prefix_cache``), else
    one is built for this call. ``kv_pool``: where the K/V tensors' memory comes from (fresh
    memory without one). ``device``: where the cache's K/V go, one device or one per layer."""
    lay = prefix_cache.spec.layout
    spans = chunk_spans(hit_tokens, lay.chunk_tokens)
    spans = [s for s in spans if s[0] < use_tokens]
    keys = prefix_cache.keys(ids[:hit_tokens])[: len(spans)]
    if not spans:
        return Restored(new_cache(config), 0, {}, ABSENT, 0)
    ring = staging if staging is not None else staging_for(prefix_cache)
    if ring.size < buffer_bytes(prefix_cache):
        raise ValueError(f"staging buffers of {ring.size} bytes cannot hold a chunk of this namespace")
    with ring.lock:
        return _restore(prefix_cache, keys, spans, use_tokens, dtype, config, device, ring, kv_pool)


def _copy_all(copies: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in copies:
        np.copyto(dst, src)


def _restore(prefix_cache: PrefixCache, keys: list[bytes], spans: list[tuple[int, int]], use_tokens: int,
             dtype: torch.dtype, config: Any, device: Devices, ring: StagingRing,
             kv_pool: KVPool | None) -> Restored:
    lay = prefix_cache.spec.layout
    batch = ring.batch
    shape = (lay.num_layers, 1, lay.num_kv_heads, use_tokens, lay.head_dim)
    alloc = fresh_kv if kv_pool is None else kv_pool.tensor
    k_out, v_out = alloc(shape, dtype), alloc(shape, dtype)
    bits, as_bits = _BITS[k_out.element_size()]
    k_np, v_np = k_out.view(as_bits).numpy(), v_out.view(as_bits).numpy()

    def read(b: int) -> VerifiedRun:
        lo, hi = b * batch, min((b + 1) * batch, len(keys))
        return prefix_cache.load_verified_into(keys[lo:hi], spans[lo:hi], ring.buffers(b)[: hi - lo], lo,
                                               prefix=keys, defer_promotion=True)

    done, per_tier, reason, nbytes = 0, dict[str, int](), ABSENT, 0
    batches = -(-len(keys) // batch)
    ahead = ring.sets - 1  # batches read ahead of the one being copied (each into its own set)
    with ThreadPoolExecutor(max_workers=READS_IN_FLIGHT, thread_name_prefix="kvtier-hf-restore") as pool, \
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier-hf-copy") as copier:
        # No pass faulting the KV tensors in first: each copy below faults in the pages it
        # writes, while the readers keep going (see the module docstring).
        pending = {b: pool.submit(read, b) for b in range(min(ahead, batches))}
        promoted: dict[int, Future[None]] = {}
        for b in range(batches):
            run = pending.pop(b).result()
            full = len(run.payloads) == min(batch, len(keys) - b * batch)
            # Batch b - 1's copy is done and, once its promotion is, batch b + ahead reads
            # into the set it used.
            nxt = b + ahead
            if b - 1 in promoted:
                promoted.pop(b - 1).result()
            if full and nxt < batches:
                pending[nxt] = pool.submit(read, nxt)
            k_copies, v_copies = [], []
            for payload, shape in zip(run.payloads, run.shapes):
                take = min(shape[2], use_tokens - done)
                src = np.frombuffer(payload, dtype=bits).reshape(shape)[:, :, :take]  # (L, 2, T, H, D)
                k_copies.append((k_np[:, 0, :, done:done + take], src[:, 0].transpose(0, 2, 1, 3)))
                v_copies.append((v_np[:, 0, :, done:done + take], src[:, 1].transpose(0, 2, 1, 3)))
                done += take
            v_done = copier.submit(_copy_all, v_copies)  # V on the copier thread, K here
            _copy_all(k_copies)
            v_done.result()
            promoted[b] = copier.submit(prefix_cache.promote, run)  # off the path to the K/V
            for name, n in run.per_tier.items():
                per_tier[name] = per_tier.get(name, 0) + n
            nbytes += run.nbytes
            if not full:
                reason = run.reason
                for later in pending.values():  # reads already started past the gap: unused
                    later.cancel()
                break
        for promotion in promoted.values():  # done before the ring is free (and raised, if a bug)
            promotion.result()
    cache = new_cache(config)
    if done:
        for layer in range(lay.num_layers):
            dev = layer_device(device, layer)
            set_layer_kv(cache, layer, k_out[layer, :, :, :done].to(dev), v_out[layer, :, :, :done].to(dev))
    return Restored(cache, done, per_tier, reason, nbytes)

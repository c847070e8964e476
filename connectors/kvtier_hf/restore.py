"""Restore a cached prefix into a transformers cache with one copy per byte, reads overlapped.

The chunk layout is ``(layers, kv=2, tokens, kv_heads, head_dim)``; transformers keeps per layer
``(1, kv_heads, seq, head_dim)``. The path, per batch of chunks:

1. the store reads the chunks straight into reusable page-aligned buffers
   (:meth:`~kvtier.cache.PrefixCache.load_verified_into`: O_DIRECT into place on disk, no
   per-chunk ``bytes``), verifying every chunk as :meth:`PrefixCache.load` does;
2. meanwhile (``READS_IN_FLIGHT`` batches read ahead, each into its own buffer set) the
   previous batch is copied, token axis and head axis swapped, straight into per-layer K and V
   tensors preallocated for the whole prefix. Two reads in flight keep the disk streaming while
   the reader threads verify and promote (at one, the restore ran at ~0.6x the tier's read);
3. the tensors are installed in the cache as they are (:func:`~kvtier_hf.compat.set_layer_kv`),
   without the ``torch.cat`` that ``DynamicCache.update`` would do.

The copy uses numpy (one thread): torch's parallel copy fights the reader thread for the cores
and, on a busy 2-core host, ran 5-10x slower than a plain strided memcpy.

Threads: ``READS_IN_FLIGHT`` reader threads per call, joined before returning. Failure: as ``PrefixCache``:
a missing or refused chunk ends the restored prefix (never an exception for store trouble).
"""

from __future__ import annotations

import math
import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.cache import PrefixCache, VerifiedRun
from kvtier.chunk import HEADER_SIZE, PAGE, dtype_itemsize, page_aligned_buffer
from kvtier.keys import chunk_spans
from kvtier.tiers.base import ABSENT
from kvtier_hf.compat import new_cache, set_layer_kv

BATCH_BYTES = 4 << 20  # chunks per read batch, by bytes: big enough to stream, small to overlap
READS_IN_FLIGHT = 2  # batches read at once while one is copied (a disk streams faster at depth 2)
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


def restore(prefix_cache: PrefixCache, ids: np.ndarray, hit_tokens: int, use_tokens: int,
            dtype: torch.dtype, config: Any = None, device: torch.device | str = "cpu") -> Restored:
    """Load up to ``use_tokens`` tokens of the ``hit_tokens``-token cached prefix of ``ids``
    into a new cache (fewer when a chunk is missing or refused)."""
    lay = prefix_cache.spec.layout
    spans = chunk_spans(hit_tokens, lay.chunk_tokens)
    spans = [s for s in spans if s[0] < use_tokens]
    keys = prefix_cache.keys(ids[:hit_tokens])[: len(spans)]
    if not spans:
        return Restored(new_cache(config), 0, {}, ABSENT, 0)
    size = buffer_bytes(prefix_cache)
    batch = max(1, BATCH_BYTES // size)
    sets = READS_IN_FLIGHT + 1  # one set being copied, the others being read into
    buffers = [[page_aligned_buffer(size) for _ in range(batch)] for _ in range(sets)]
    k_out = torch.empty((lay.num_layers, 1, lay.num_kv_heads, use_tokens, lay.head_dim), dtype=dtype)
    v_out = torch.empty_like(k_out)
    bits, as_bits = _BITS[k_out.element_size()]
    k_np, v_np = k_out.view(as_bits).numpy(), v_out.view(as_bits).numpy()

    def read(b: int) -> VerifiedRun:
        lo, hi = b * batch, min((b + 1) * batch, len(keys))
        return prefix_cache.load_verified_into(keys[lo:hi], spans[lo:hi], buffers[b % sets][: hi - lo], lo,
                                               prefix=keys)

    done, per_tier, reason, nbytes = 0, dict[str, int](), ABSENT, 0
    batches = -(-len(keys) // batch)
    with ThreadPoolExecutor(max_workers=READS_IN_FLIGHT, thread_name_prefix="kvtier-hf-restore") as pool:
        pending = {b: pool.submit(read, b) for b in range(min(READS_IN_FLIGHT, batches))}
        # While the first batches are read: fault in the output tensors' pages (a fresh
        # allocation), so the copies below run at copy speed instead of page-fault speed.
        for out in (k_np, v_np):
            out.reshape(-1)[:: mmap.PAGESIZE // out.itemsize] = 0
        for b in range(batches):
            run = pending.pop(b).result()
            full = len(run.payloads) == min(batch, len(keys) - b * batch)
            # Keep READS_IN_FLIGHT reads going while this batch is copied: batch b + depth reads
            # into the buffer set batch b - 1 used, whose copy is done.
            nxt = b + READS_IN_FLIGHT
            if full and nxt < batches:
                pending[nxt] = pool.submit(read, nxt)
            for payload, shape in zip(run.payloads, run.shapes):
                take = min(shape[2], use_tokens - done)
                src = np.frombuffer(payload, dtype=bits).reshape(shape)[:, :, :take]  # (L, 2, T, H, D)
                np.copyto(k_np[:, 0, :, done:done + take], src[:, 0].transpose(0, 2, 1, 3))
                np.copyto(v_np[:, 0, :, done:done + take], src[:, 1].transpose(0, 2, 1, 3))
                done += take
            for name, n in run.per_tier.items():
                per_tier[name] = per_tier.get(name, 0) + n
            nbytes += run.nbytes
            if not full:
                reason = run.reason
                for later in pending.values():  # reads already started past the gap: unused
                    later.cancel()
                break
    cache = new_cache(config)
    if done:
        for layer in range(lay.num_layers):
            set_layer_kv(cache, layer, k_out[layer, :, :, :done].to(device),
                         v_out[layer, :, :, :done].to(device))
    return Restored(cache, done, per_tier, reason, nbytes)


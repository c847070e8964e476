"""The token side of the cross-engine key schema ``kvtier/x1`` (docs/sglang.md).

SGLang's backend sees only page hashes; an engine that holds the prompt's tokens (transformers,
vLLM, a prefill service) computes the same page chain from them (``kvtier.keys.xengine_keys``)
and reads or writes the same chunks, in kvtier's canonical payload order
``(layers, kv, page_tokens, heads, head_dim)``. The ``PrefixCache`` given must be bound to the
shared namespace with ``chunk_tokens`` equal to SGLang's page size. Engine-neutral: payloads
are bytes (kvtier_hf.kv converts a transformers cache), no SGLang import.
Placement: every verb gets the prompt's whole page chain as its prefix (``prefix=keys``), as
PrefixCache's own save/load do, so a kvtier-server cluster places these pages where the other
connectors and SGLang's backend (with prefix keys on: prefix.py) look for them.
Threads and failure: as PrefixCache (thread-safe; store trouble is a shorter run, never a raise).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kvtier.cache import LoadedPrefix, PrefixCache
from kvtier.chunk import encode_chunk
from kvtier.codec import Buf
from kvtier.keys import xengine_keys
from kvtier.tiers.base import Entry

Tokens = Sequence[int] | np.ndarray


def save_pages(cache: PrefixCache, tokens: Tokens, payload_for: Callable[[int, int], Buf], *,
               seed: bytes | None = None) -> int:
    """Store every full page of ``tokens`` not stored yet; ``payload_for(start, end)`` returns a
    page's canonical K/V bytes. ``seed``: the request's page-chain seed
    (``kvtier.keys.page_hash_seed(extra_key, cache_salt)``). Returns #pages the first tier took."""
    page = cache.chunk_tokens
    keys = xengine_keys(cache.namespace, tokens, page, seed)
    first = cache.store.lookup(keys, prefix=keys).hits
    shape = cache.spec.layout.chunk_shape(page)
    entries = [Entry(keys[i], encode_chunk(cache.namespace, keys[i], cache.spec.kv_dtype, shape,
                                           payload_for(i * page, (i + 1) * page), codec=cache.codec,
                                           shuffle=cache.shuffle), i, keys[i - 1] if i else b"")
               for i in range(first, len(keys))]
    return cache.store.store(entries, prefix=keys)


def load_pages(cache: PrefixCache, tokens: Tokens, *, seed: bytes | None = None) -> LoadedPrefix:
    """The verified leading pages of ``tokens`` (``tokens`` of the result = pages * page size)."""
    page = cache.chunk_tokens
    keys = xengine_keys(cache.namespace, tokens, page, seed)
    run = cache.load_verified(keys, [(i * page, (i + 1) * page) for i in range(len(keys))], prefix=keys)
    return LoadedPrefix(len(run.payloads) * page, run.payloads, run.shapes, run.per_tier, run.reason)

"""Deferred promotion (``load_into(..., defer_promotion=True)``): the bytes come back first, the
copies into the tiers above happen when the caller says, and only for chunks it verified."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.config import StoreConfig
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry
from kvtier.tiers.memory import MemoryTier

SPEC = NamespaceSpec("test-model", KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=4))


def _saved(store: TieredStore, lower: MemoryTier, chunks: int) -> tuple[PrefixCache, np.ndarray, list[bytes]]:
    """A prefix of ``chunks`` chunks held by ``lower`` only."""
    cache = PrefixCache(store, SPEC)
    tokens = np.arange(4 * chunks)
    kv = np.random.default_rng(1).standard_normal((2, 2, 4 * chunks, 2, 4)).astype(np.float16)
    cache.save(tokens, lambda s, e: np.ascontiguousarray(kv[:, :, s:e]).tobytes())
    store.flush(10)
    keys = cache.keys(tokens)
    store.tiers[0].delete(keys)
    assert lower.contains(keys) == chunks and store.tiers[0].contains(keys) == 0
    return cache, tokens, keys


def _outs(n: int) -> list[memoryview]:
    return [memoryview(bytearray(1 << 12)) for _ in range(n)]


def test_deferred_promotion_waits_for_promote_and_takes_the_count_given() -> None:
    top, lower = MemoryTier(name="top"), MemoryTier(name="lower")
    with TieredStore([top, lower]) as store:
        cache, _, keys = _saved(store, lower, 3)
        outs = _outs(3)
        res = store.load_into(keys, outs, defer_promotion=True)
        assert res.sources == ["lower"] * 3 and len(res.chunks) == 3
        assert top.contains(keys) == 0                       # nothing copied up yet
        assert res.promotion.keys == tuple(keys) and res.promotion.levels == (1, 1, 1)
        store.promote(res.promotion, 2)
        assert [top.contains([k]) for k in keys] == [1, 1, 0]
        assert top.get(keys[:2]) == [bytes(c) for c in res.chunks[:2]]
        # the default still promotes before returning, and leaves nothing pending
        top.delete(keys)
        res = store.load_into(keys, _outs(3))
        assert top.contains(keys) == 3 and res.promotion.keys == ()


def test_a_deferred_run_promotes_only_its_verified_chunks() -> None:
    """A corrupt chunk ends the run: the chunks before it are promoted, it is not (the eager
    path promotes it, then deletes it everywhere)."""
    top, lower = MemoryTier(name="top"), MemoryTier(name="lower")
    with TieredStore([top, lower]) as store:
        cache, _, keys = _saved(store, lower, 3)
        bad = bytearray(lower.get([keys[1]])[0])  # type: ignore[arg-type]
        bad[-1] ^= 1
        lower.put([Entry(keys[1], bytes(bad))])
        run = cache.load_verified_into(keys, [(0, 4), (4, 8), (8, 12)], _outs(3), defer_promotion=True)
        assert len(run.payloads) == 1 and run.reason == "corrupt"
        assert top.contains(keys) == 0
        cache.promote(run)
        assert [top.contains([k]) for k in keys] == [1, 0, 0]
        assert lower.contains(keys[1:2]) == 0               # the refused chunk is dropped below too


def test_promote_respects_promote_on_load_off() -> None:
    top, lower = MemoryTier(name="top"), MemoryTier(name="lower")
    with TieredStore([top, lower], StoreConfig(promote_on_load=False)) as store:
        cache, _, keys = _saved(store, lower, 2)
        run = cache.load_verified_into(keys, [(0, 4), (4, 8)], _outs(2), defer_promotion=True)
        cache.promote(run)
        assert len(run.payloads) == 2 and top.contains(keys) == 0


class _Recording(MemoryTier):
    """A memory tier that keeps every entry it was handed (to see the chain links)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.seen: list[Entry] = []

    def put(self, entries):  # type: ignore[no-untyped-def]
        self.seen.extend(entries)
        return super().put(entries)


def test_promotions_and_selective_write_downs_carry_each_chunks_parent() -> None:
    """Prefix-aware policies weigh a chunk by its chain; promoted and selectively written
    chunks came without their parent, so those policies saw every one as a root."""
    top, lower = _Recording("top"), _Recording("lower")
    store = TieredStore([top, lower], StoreConfig(write_policy="write_through"))
    _, _, keys = _saved(store, lower, 3)
    # From now on a chunk is written down when loaded once (the write-behind cascades either way).
    store.config = dataclasses.replace(store.config, write_policy="write_through_selective", selective_min_hits=1)
    top.seen.clear()
    lower.seen.clear()
    store.load(keys)  # served by lower: promoted into top, and due for the write-down
    store.flush(10)
    for tier in (top, lower):
        links = {e.key: (e.depth, e.parent) for e in tier.seen}
        assert [links[k] for k in keys] == [(0, b""), (1, keys[0]), (2, keys[1])], tier.name
    store.close()

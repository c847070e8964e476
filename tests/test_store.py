"""TieredStore and PrefixCache semantics over in-process tiers (no timing assertions)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest

from kvtier.cache import PrefixCache
from kvtier.chunk import HEADER_SIZE, encode_chunk
from kvtier.config import StoreConfig
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry, Probe
from kvtier.tiers.memory import MemoryTier
from tests.fakes import RaisingTier

LAY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=4)
SPEC = NamespaceSpec("test-model", LAY)


class BlockingTier(MemoryTier):
    """A tier whose writes wait until released: stands in for a stalled remote node."""

    def __init__(self, name: str) -> None:
        super().__init__(1 << 30, name=name)
        self.release = threading.Event()

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        self.release.wait(10)
        return super().put(entries)


def _kv(tokens: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 2, tokens, 2, 4)).astype(np.float16)


def _payload_fn(kv: np.ndarray):  # type: ignore[no-untyped-def]
    return lambda s, e: np.ascontiguousarray(kv[:, :, s:e]).tobytes()


def _join(loaded) -> np.ndarray:  # type: ignore[no-untyped-def]
    parts = [np.frombuffer(p, np.float16).reshape(s) for p, s in zip(loaded.payloads, loaded.shapes)]
    return np.concatenate(parts, axis=2)


def _entries(n: int, size: int = 100) -> tuple[list[bytes], list[Entry]]:
    keys = [bytes([i]) * 32 for i in range(1, n + 1)]
    return keys, [Entry(k, bytes([i]) * size, i) for i, k in enumerate(keys)]


def test_lookup_counts_leading_run_across_tiers_and_fills_gaps() -> None:
    a, b = MemoryTier(name="a"), MemoryTier(name="b")
    keys, entries = _entries(5)
    a.put([entries[0], entries[2]])
    b.put([entries[1], entries[3]])
    with TieredStore([a, b]) as store:
        res = store.lookup(keys)
        assert res.hits == 4 and res.per_tier == {"a": 2, "b": 2}
        assert [name for name, _ in res.runs] == ["a", "b", "a", "b"]
        assert store.lookup(keys[1:]).hits == 3 and store.lookup([keys[4]]).hits == 0


class CountingTier(MemoryTier):
    """Counts the probes it answers (each is a round trip on a remote tier)."""

    def __init__(self, name: str) -> None:
        super().__init__(name=name)
        self.probes = 0

    def _probe(self, keys: Sequence[bytes]) -> Probe:
        self.probes += 1
        return super()._probe(keys)


def test_lookup_asks_no_tier_again_where_it_already_missed() -> None:
    """A tier whose probe stopped at position p said keys[p] is missing there: the lookup's
    next pass asks it again only from a later position. Every lookup that stopped short
    asked every tier twice (a remote tier: 400 engine lookups made 1251 node lookups)."""
    a, b, c = CountingTier("a"), CountingTier("b"), CountingTier("c")
    keys, entries = _entries(5)
    a.put(entries[:3])
    with TieredStore([a, b, c]) as store:
        assert store.lookup(keys).hits == 3
        assert (a.probes, b.probes, c.probes) == (1, 1, 1)
        b.put([entries[3]])  # now a gap filled by b: a is asked again past it, b and c are not
        assert store.lookup(keys).hits == 4
        assert (a.probes, b.probes, c.probes) == (3, 2, 2)
        a.put([entries[4]])  # a holds the key after b's: found on a's second probe
        res = store.lookup(keys)
        assert res.hits == 5 and [name for name, _ in res.runs] == ["a", "b", "a"]


def test_load_promotes_into_upper_tiers_unless_disabled() -> None:
    for promote in (True, False):
        a, b = MemoryTier(name="a"), MemoryTier(name="b")
        keys, entries = _entries(3)
        b.put(entries)
        with TieredStore([a, b], StoreConfig(promote_on_load=promote)) as store:
            res = store.load(keys)
            assert res.chunks == [e.data for e in entries] and res.sources == ["b"] * 3
            assert a.contains(keys) == (3 if promote else 0)


def test_write_through_cascades_and_flush_waits() -> None:
    a, b, c = MemoryTier(name="a"), MemoryTier(name="b"), MemoryTier(name="c")
    keys, entries = _entries(4)
    with TieredStore([a, b, c]) as store:
        assert store.store(entries) == 4
        assert store.flush(5)
        assert a.contains(keys) == b.contains(keys) == c.contains(keys) == 4


def test_full_queue_drops_writes_and_never_blocks_the_caller() -> None:
    a, slow = MemoryTier(name="a"), BlockingTier("slow")
    with TieredStore([a, slow], StoreConfig(queue_depth=2)) as store:
        for i in range(10):
            keys, entries = _entries(1)
            store.store([Entry(bytes([i + 1]) * 32, b"x" * 10)])  # returns at once even though slow is stuck
        dropped = store.metrics.registry.get_sample_value(
            "kvtier_store_dropped_writes_total", {"tier": "slow", "reason": "queue_full"})
        assert dropped is not None and dropped >= 7
        slow.release.set()
        assert store.flush(10)
        assert 1 <= slow.usage().entries <= 3
        assert a.usage().entries == 10


def test_a_tier_that_raises_costs_its_batch_not_the_writer(caplog: pytest.LogCaptureFixture) -> None:
    """The write-behind thread outlives a tier's exception: that batch is dropped (counted,
    logged with its traceback), later batches are written, flush and close return. Before,
    the thread died: flush waited forever and close blocked on a full queue."""
    a, buggy = MemoryTier(name="a"), RaisingTier("buggy", times=2)
    with TieredStore([a, buggy], StoreConfig(queue_depth=2)) as store:
        for i in range(4):
            store.store([Entry(bytes([i + 1]) * 32, b"x" * 10)])
            assert store.flush(5)
        dropped = store.metrics.registry.get_sample_value(
            "kvtier_store_dropped_writes_total", {"tier": "buggy", "reason": "error"})
        assert dropped == 2 and buggy.usage().entries == 2 and a.usage().entries == 4
    assert "a bug in a tier" in caplog.text


def test_write_back_cascades_only_on_eviction() -> None:
    a, b = MemoryTier(capacity_bytes=250, name="a"), MemoryTier(name="b")
    keys, entries = _entries(3)
    with TieredStore([a, b], StoreConfig(write_policy="write_back")) as store:
        store.store(entries[:2])
        store.flush(5)
        assert b.usage().entries == 0
        store.store(entries[2:])  # evicts the LRU chunk of a into b
        store.flush(5)
        assert b.contains([keys[0]]) == 1 and store.lookup(keys).hits == 3
        evictions = store.metrics.registry.get_sample_value(
            "kvtier_evictions_total", {"tier": "a", "reason": "capacity"})
        assert evictions == 1


def test_write_through_selective_waits_for_hits() -> None:
    a, b = MemoryTier(name="a"), MemoryTier(name="b")
    keys, entries = _entries(2)
    cfg = StoreConfig(write_policy="write_through_selective", selective_min_hits=2)
    with TieredStore([a, b], cfg) as store:
        store.store(entries)
        store.load(keys)
        store.flush(5)
        assert b.usage().entries == 0
        store.load(keys)
        store.flush(5)
        assert b.contains(keys) == 2


def test_evicted_miss_reason() -> None:
    a = MemoryTier(capacity_bytes=150, name="a")
    keys, entries = _entries(2)
    with TieredStore([a]) as store:
        store.store(entries)
        res = store.lookup(keys)
        assert res.hits == 0 and res.reason == "evicted"
        assert store.lookup([b"\xee" * 32]).reason == "absent"


def test_prefix_cache_round_trip_and_partial_chunk() -> None:
    with TieredStore([MemoryTier(name="a"), MemoryTier(name="b")]) as store:
        cache = PrefixCache(store, SPEC)
        tokens, kv = np.arange(10), _kv(10)
        assert cache.save(tokens, _payload_fn(kv)) == 3
        assert cache.save(tokens, _payload_fn(kv)) == 0  # already cached: nothing re-encoded
        hit = cache.lookup(tokens)
        assert (hit.tokens, hit.chunks) == (10, 3)
        loaded = cache.load(tokens)
        assert loaded.tokens == 10 and np.array_equal(_join(loaded), kv)
        longer = np.concatenate([tokens[:8], [77, 78, 79]])
        assert cache.lookup(longer).tokens == 8  # partial tails match only the same tokens
        assert cache.load(tokens, max_tokens=9).tokens == 8
        m = store.metrics.registry.get_sample_value
        assert m("kvtier_lookup_hit_tokens_total", {"tier": "a", "tenant": ""}) == 18
        assert m("kvtier_lookup_miss_tokens_total", {"reason": "absent", "tenant": ""}) == 3


def test_store_chunks_writes_the_named_chunks_with_or_without_the_lookup() -> None:
    with TieredStore([MemoryTier(name="a")]) as store:
        cache = PrefixCache(store, SPEC)
        tokens, kv = np.arange(16), _kv(16)
        keys = cache.keys(tokens, full_chunks_only=True)

        def payload(i: int) -> bytes:
            return _payload_fn(kv)(4 * i, 4 * i + 4)

        assert cache.store_chunks(keys, [0, 2], payload, skip_held=False) == 2
        assert cache.lookup(tokens).chunks == 1  # chunk 1 is missing: the run ends there
        assert cache.store_chunks(keys, [0, 1], payload) == 1  # chunk 0 is held: skipped
        assert cache.store_chunks(keys, [0, 1, 2], payload) == 0
        assert cache.store_chunks(keys, [], payload) == 0
        assert cache.store_chunks(keys, [3], payload, skip_held=False) == 1
        loaded = cache.load(tokens)
        assert loaded.tokens == 16 and np.array_equal(_join(loaded), kv)


@pytest.mark.parametrize("tiers", [1, 2])
def test_store_chunks_framed_stores_the_buffer_itself_only_when_the_store_keeps_no_entry(tiers: int) -> None:
    # One tier: put copies before store() returns, so the caller's buffer (header room + K/V)
    # is framed in place and stored as is. Two write-through tiers: the cascade queues the
    # entries, so the store gets an encoded copy and the caller's buffer is left as it was.
    config = StoreConfig(write_policy="write_through")
    with TieredStore([MemoryTier(name=f"t{i}") for i in range(tiers)], config) as store:
        cache = PrefixCache(store, SPEC)
        assert cache.frames_in_place() is (tiers == 1)
        tokens, kv = np.arange(12), _kv(12)
        keys = cache.keys(tokens, full_chunks_only=True)
        bufs = [bytearray(HEADER_SIZE) + bytearray(_payload_fn(kv)(4 * i, 4 * i + 4)) for i in range(3)]
        assert cache.store_chunks(keys, [0, 1, 2], lambda i: bufs[i], skip_held=False, framed=True) == 3
        framed = [bytes(b[:HEADER_SIZE]) != bytes(HEADER_SIZE) for b in bufs]
        assert framed == [tiers == 1] * 3
        if tiers == 1:  # the stored chunk is the caller's buffer, header and all
            assert store.tiers[0].get([keys[1]])[0] == bytes(bufs[1])
        for b in bufs:  # the caller reuses its buffers once store_chunks returned
            b[HEADER_SIZE:] = bytes(len(b) - HEADER_SIZE)
        assert store.flush(timeout_s=10)
        loaded = cache.load(tokens)
        assert loaded.tokens == 12 and np.array_equal(_join(loaded), kv)
        if tiers == 2:
            store.tiers[0].delete(keys)
            loaded = cache.load(tokens)  # from the lower tier, written from the copy
            assert loaded.tokens == 12 and np.array_equal(_join(loaded), kv)


def test_corrupt_chunk_ends_the_run_is_counted_and_dropped() -> None:
    a = MemoryTier(name="a")
    with TieredStore([a]) as store:
        cache = PrefixCache(store, SPEC)
        tokens, kv = np.arange(12), _kv(12)
        cache.save(tokens, _payload_fn(kv))
        keys = cache.keys(tokens)
        bad = bytearray(a.get([keys[1]])[0])  # type: ignore[arg-type]
        bad[-1] ^= 1
        a.put([Entry(keys[1], bytes(bad))])
        loaded = cache.load(tokens)
        assert loaded.tokens == 4 and loaded.reason == "corrupt"
        assert np.array_equal(_join(loaded), kv[:, :, :4])
        assert a.contains([keys[1]]) == 0
        assert store.metrics.registry.get_sample_value("kvtier_chunk_errors_total", {"reason": "corrupt"}) == 1


@pytest.mark.parametrize("other", [
    NamespaceSpec("other-model", LAY),
    NamespaceSpec("test-model", LAY, kv_dtype="bfloat16"),
    NamespaceSpec("test-model", LAY, salt=b"tenant-b"),
])
def test_foreign_namespace_never_hits_and_forged_chunks_are_refused(other: NamespaceSpec) -> None:
    with TieredStore([MemoryTier(name="a")]) as store:
        mine, theirs = PrefixCache(store, SPEC), PrefixCache(store, other)
        tokens, kv = np.arange(8), _kv(8)
        theirs.save(tokens, _payload_fn(kv))
        assert mine.lookup(tokens).tokens == 0
        # Forge: their bytes planted under my key must still be refused by the decoder.
        key = mine.keys(tokens)[0]
        data = theirs.store.load(theirs.keys(tokens)[:1]).chunks[0]
        store.tiers[0].put([Entry(key, data)])
        loaded = mine.load(tokens)
        assert loaded.tokens == 0 and loaded.reason in ("namespace_mismatch", "key_mismatch")


def test_wrong_layout_chunk_is_refused() -> None:
    with TieredStore([MemoryTier(name="a")]) as store:
        cache = PrefixCache(store, SPEC)
        tokens = np.arange(4)
        key = cache.keys(tokens)[0]
        wrong = encode_chunk(cache.namespace, key, "float16", (2, 2, 4, 1, 8), b"\0" * 256)
        store.store([Entry(key, wrong)])
        loaded = cache.load(tokens)
        assert loaded.tokens == 0 and loaded.reason == "layout_mismatch"


def test_store_after_close_raises_and_metrics_render() -> None:
    store = TieredStore([MemoryTier(name="a")])
    store.store(_entries(1)[1])
    store.stats()
    text = store.metrics.exposition().decode()
    assert "kvtier_tier_used_bytes" in text and "kvtier_store_queue_depth" in text
    store.close()
    with pytest.raises(RuntimeError):
        store.store(_entries(1)[1])


def test_chunk_larger_than_cpu_slot_is_a_config_error() -> None:
    from kvtier.config import CpuTierConfig
    from kvtier.errors import ConfigError
    from kvtier.tiers.cpu import CpuTier

    big = NamespaceSpec("m", KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, chunk_tokens=256))
    with TieredStore([CpuTier(CpuTierConfig(capacity_bytes=8 << 20, slot_bytes=4 << 20))]) as store:
        with pytest.raises(ConfigError, match="cpu.slot_bytes"):
            PrefixCache(store, big)
        PrefixCache(store, big, codec="lz4")  # may fit once compressed: warning only


def test_load_into_matches_load_and_leaves_the_buffers_to_the_caller() -> None:
    """Same run, sources and promotion as load(); the caller may scribble over its buffers
    right after, without touching what was promoted; a gap ends the run with its reason."""
    a, b = MemoryTier(name="a"), MemoryTier(name="b")
    keys, entries = _entries(4)
    a.put([entries[0]])
    b.put(entries[1:3])  # key 3 is nowhere
    with TieredStore([a, b]) as store:
        outs = [memoryview(bytearray(128)) for _ in keys]
        res = store.load_into(keys, outs)
        assert [bytes(c) for c in res.chunks] == [e.data for e in entries[:3]]
        assert res.sources == ["a", "b", "b"] and res.reason == "absent"
        assert all(c.obj is o.obj for c, o in zip(res.chunks, outs))  # views of the caller's buffers
        for out in outs:
            out[:] = b"\xff" * 128
        assert a.contains(keys) == 3 and a.get(keys[1:3]) == [e.data for e in entries[1:3]]
        with pytest.raises(ValueError, match="2 keys and 1 buffers"):
            store.load_into(keys[:2], outs[:1])


def test_load_into_hands_an_oversized_chunk_to_the_verifier() -> None:
    """A stored chunk larger than the caller's buffer is not a chunk of its layout: it reaches
    the caller as bytes (never as an exception), and PrefixCache refuses it by name."""
    big = NamespaceSpec("test-model", KVLayout(num_layers=2, num_kv_heads=3, head_dim=4, chunk_tokens=4))
    a = MemoryTier(name="a")
    with TieredStore([a]) as store:
        cache = PrefixCache(store, SPEC)
        tokens = np.arange(8)
        keys = cache.keys(tokens)
        forged = encode_chunk(cache.namespace, keys[0], "float16", big.layout.chunk_shape(4),
                              np.zeros(big.layout.chunk_shape(4), np.float16).tobytes())
        a.put([Entry(keys[0], forged)])
        fit = len(forged) - 1
        res = store.load_into(keys[:1], [memoryview(bytearray(fit))])
        assert res.chunks == [forged]
        run = cache.load_verified_into(keys[:1], [(0, 4)], [memoryview(bytearray(fit))])
        assert run.payloads == [] and run.reason == "layout_mismatch"
        assert a.contains(keys[:1]) == 0  # the refused chunk is dropped, as load() does


def test_a_refused_overwrite_keeps_the_old_chunk() -> None:
    """MemoryTier: the rest of the tier is pinned, so a larger chunk for a held key cannot get
    room; the put is refused and the key still holds its old chunk (it was deleted first)."""
    tier = MemoryTier(capacity_bytes=300, name="m")
    a, b = b"a" * 32, b"b" * 32
    assert tier.put([Entry(a, b"1" * 100), Entry(b, b"2" * 100)]) == [True, True]
    tier.pin([b])
    assert tier.put([Entry(a, b"3" * 250)]) == [False]
    assert tier.get([a]) == [b"1" * 100] and tier.check() == []


def test_a_store_racing_close_leaves_no_task_behind_the_writer() -> None:
    """store() that passed its closed check while close() ran: its write-down once landed
    behind the writer's stop mark, never written, and flush() without a timeout hung."""

    class SlowTop(MemoryTier):
        entered = threading.Event()

        def put(self, entries: Sequence[Entry]) -> list[bool]:
            out = super().put(entries)
            self.entered.set()
            self.proceed.wait(5)
            return out

        proceed = threading.Event()

    top, low = SlowTop(1 << 20, name="top"), MemoryTier(1 << 20, name="low")
    store = TieredStore([top, low], StoreConfig(write_policy="write_through"))
    racer = threading.Thread(target=store.store, args=([Entry(b"k" * 32, b"v" * 100)],))
    racer.start()
    assert SlowTop.entered.wait(5)
    closer = threading.Thread(target=store.close)
    closer.start()
    closer.join(0.2)  # close() has queued its stop mark (the writer had nothing to do)
    SlowTop.proceed.set()
    racer.join(5)
    closer.join(5)
    assert not racer.is_alive() and not closer.is_alive()
    assert store.flush(timeout_s=0)  # nothing left queued
    assert store.metrics.dropped_writes.labels("low", "closed")._value.get() == 1

"""The tier contract as a reusable test suite (kvtier/tiers/base.py states the contract).

Plugging a tier in
------------------
Subclass :class:`TierContract` in a ``test_*.py`` module and give the class a ``make_tier``
fixture: a factory ``make_tier(capacity_bytes) -> Tier`` that returns a fresh, empty tier
bounded to about that many bytes, and closes every tier it made at teardown::

    class TestMyTier(TierContract):
        @pytest.fixture
        def make_tier(self, tmp_path):
            made = []
            def factory(capacity_bytes: int) -> Tier:
                tier = MyTier(MyTierConfig(capacity_bytes=capacity_bytes, ...))
                made.append(tier)
                return tier
            yield factory
            for tier in made:
                tier.close()

Class attributes let a tier opt out of what its medium cannot promise:

- ``reports_evicted`` (True): a tier that cannot tell an evicted key from one never written
  (a remote store evicting on its own) sets False; misses may then say ``absent``.
- ``enforces_capacity`` (True): False only for a tier whose bound cannot be set small by its
  fixture; the capacity tests then only check that puts never raise. A remote tier keeps it:
  its fixture sets the bound in the other process (a Redis ``maxmemory`` with
  ``allkeys-lru``, a kvtier-server tenant quota) and sets ``capacity`` to what ``usage()``
  reports, so the checks observe the bound and the eviction through the client.
- ``exact_eviction`` (True): a tier whose eviction samples its victims (Redis' approximate
  LRU, whose clock ticks once a second, may pick a chunk written a moment ago) sets False;
  a just-written chunk must then be readable on at least 90% of puts instead of all.
- ``overfill`` (8): the capacity test writes ``overfill`` x capacity (the eviction test half
  that, at least 1x); a remote tier, where each put is a round trip, may lower it as long as
  the puts still exceed what the medium holds (a Redis' ``maxmemory`` counts its own ~1-2
  MiB, so 1x of it already overflows).
- ``exact_usage`` (True): a tier whose ``used_bytes`` is the medium's own figure (Redis'
  ``used_memory_dataset`` moves by KiBs with client buffers) sets False; byte-accounting
  checks are then skipped.

The suite uses real encoded chunks (``kvtier.chunk.encode_chunk``) of a few KiB, compares
bytes only, and assumes no eviction order. Every scenario ends with ``tier.check() == []``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvtier.chunk import decode_chunk, encode_chunk
from kvtier.tiers.base import ABSENT, EVICTED, Entry, Miss, Tier

NAMESPACE = hashlib.sha256(b"kvtier contract namespace").digest()
DTYPE = "float16"
Factory = Callable[[int], Any]


def key_of(name: str | int) -> bytes:
    return hashlib.sha256(f"contract-key/{name}".encode()).digest()


def chunk_for(key: bytes, tokens: int = 16, salt: int = 0) -> bytes:
    """A real encoded chunk whose payload is derived from ``key`` (and ``salt``), so any
    reader can recompute the bytes a key must map to."""
    shape = (2, 2, tokens, 2, 8)
    rng = np.random.default_rng(int.from_bytes(key[:8], "little") ^ salt)
    payload = rng.integers(0, 256, size=int(np.prod(shape)) * 2, dtype=np.uint8)
    return bytes(encode_chunk(NAMESPACE, key, DTYPE, shape, payload.tobytes()))


LEAF_FIRST = ["prefix", "lfu", "adaptive", "dueling"]  # the prefix-aware eviction policies


def chains(tag: str, n: int, depth: int) -> list[list[Entry]]:
    """``n`` prefixes of ``depth`` chunks each, every chunk linked to the one before it."""
    out = []
    for c in range(n):
        keys = [key_of(f"{tag}{c}/{d}") for d in range(depth)]
        out.append([Entry(k, chunk_for(k), d, keys[d - 1] if d else b"") for d, k in enumerate(keys)])
    return out


CHUNK = len(chunk_for(key_of(0)))  # bytes of a default test chunk (2176)


class TierContract:
    """Generic tests every tier must pass; see the module docstring for how to plug in."""

    reports_evicted = True
    enforces_capacity = True
    exact_usage = True
    exact_eviction = True
    overfill = 8
    capacity = 64 * 1024  # room for a couple dozen test chunks

    # --- basic verbs ----------------------------------------------------------------------
    def test_round_trip(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        keys = [key_of(i) for i in range(8)]
        chunks = [chunk_for(k, tokens=8 + i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c, depth=i) for i, (k, c) in enumerate(zip(keys, chunks))]) == [True] * 8
        got = tier.get(keys)
        assert got == chunks
        for k, value in zip(keys, got):
            assert isinstance(value, bytes)
            assert decode_chunk(value, namespace=NAMESPACE, key=k, verify=True).header.key == k
        assert tier.usage().entries == 8
        assert tier.check() == []

    def test_put_copies_caller_buffer(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        key = key_of("copy")
        original = chunk_for(key)
        buf = bytearray(original)
        assert tier.put([Entry(key, buf)]) == [True]
        buf[200:300] = bytes(100)  # the caller reuses its buffer at once
        assert tier.get([key]) == [original]
        assert tier.put([Entry(key_of("mv"), memoryview(bytearray(chunk_for(key_of("mv")))))]) == [True]
        assert tier.get([key_of("mv")]) == [chunk_for(key_of("mv"))]
        assert tier.check() == []

    def test_probe_counts_leading_hits(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        keys = [key_of(f"p{i}") for i in range(6)]
        present = [0, 1, 2, 4]
        assert tier.put([Entry(keys[i], chunk_for(keys[i])) for i in present]) == [True] * 4
        assert tier.contains(keys) == 3
        probe = tier.probe(keys)
        assert (probe.hits, probe.reason) == (3, ABSENT)
        assert tier.contains(keys[:3]) == 3
        assert tier.probe(keys[:3]).hits == 3
        assert tier.contains([]) == 0
        assert tier.contains([keys[3], keys[0]]) == 0
        assert tier.contains(keys[4:]) == 1
        assert tier.check() == []

    def test_get_absent_is_a_miss_with_reason(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        key = key_of("there")
        tier.put([Entry(key, chunk_for(key))])
        got = tier.get([key_of("never"), key, key_of("never2")])
        assert got[0] == Miss(ABSENT) and got[2] == Miss(ABSENT)
        assert got[1] == chunk_for(key)
        assert tier.check() == []

    def test_delete(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        keys = [key_of(f"d{i}") for i in range(4)]
        tier.put([Entry(k, chunk_for(k)) for k in keys])
        assert tier.delete(keys[:2] + [key_of("absent")]) == 2
        assert tier.get(keys[:2]) == [Miss(ABSENT), Miss(ABSENT)]
        assert tier.get(keys[2:]) == [chunk_for(k) for k in keys[2:]]
        assert tier.contains(keys) == 0
        assert tier.contains(keys[2:]) == 2
        assert tier.delete(keys[:2]) == 0
        assert tier.usage().entries == 2
        assert tier.check() == []

    def test_overwrite(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        key = key_of("over")
        first, second = chunk_for(key, tokens=16), chunk_for(key, tokens=8, salt=7)
        assert tier.put([Entry(key, first)]) == [True]
        assert tier.put([Entry(key, second)]) == [True]
        assert tier.get([key]) == [second]
        assert tier.usage().entries == 1
        used = tier.usage().used_bytes
        assert tier.put([Entry(key, first)]) == [True]
        assert tier.get([key]) == [first]
        assert tier.usage().entries == 1
        if self.exact_usage:
            assert tier.usage().used_bytes >= used
        assert tier.check() == []

    def test_get_into_equals_get(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        keys = [key_of(f"gi{i}") for i in range(4)]
        chunks = [chunk_for(k, tokens=4 * (i + 1)) for i, k in enumerate(keys)]
        tier.put([Entry(k, c) for k, c in zip(keys, chunks)])
        want = keys + [key_of("gi-absent")]
        outs = [memoryview(bytearray(CHUNK + 8192)) for _ in want]
        results = tier.get_into(want, outs)
        assert results[-1] == Miss(ABSENT)
        for res, out, value in zip(results, outs, tier.get(want)):
            if isinstance(value, Miss):
                continue
            assert res == len(value)
            assert bytes(out[: len(value)]) == value
        exact = [memoryview(bytearray(len(c))) for c in chunks]  # a buffer of exactly the size
        assert tier.get_into(keys, exact) == [len(c) for c in chunks]
        assert [bytes(b) for b in exact] == chunks
        with pytest.raises(ValueError):
            tier.get_into(keys[-1:], [memoryview(bytearray(len(chunks[-1]) - 1))])
        with pytest.raises(ValueError):
            tier.get_into(keys, outs[:1])
        assert tier.check() == []

    def test_wrong_key_length_raises(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        bad = [b"short"]
        for call in (lambda: tier.probe(bad), lambda: tier.contains(bad), lambda: tier.get(bad),
                     lambda: tier.get_into(bad, [memoryview(bytearray(16))]),
                     lambda: tier.put([Entry(b"x" * 33, chunk_for(key_of(0)))]),
                     lambda: tier.delete(bad)):
            with pytest.raises(ValueError):
                call()
        assert tier.check() == []

    # --- capacity and eviction ---------------------------------------------------------------
    def test_capacity_bound_under_many_puts(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        rng = random.Random(1)
        keys = [key_of(f"cap{i}") for i in range(self.overfill * self.capacity // CHUNK)]
        chunks = [chunk_for(k, tokens=rng.choice((4, 8, 16, 24))) for k in keys]
        fresh_misses: list[object] = []
        for i, (key, chunk) in enumerate(zip(keys, chunks)):
            ok = tier.put([Entry(key, chunk, depth=i)])
            assert ok == [True]  # a full tier evicts, it never refuses a chunk that fits
            (got,) = tier.get([key])  # what was just written is readable
            if self.exact_eviction or not isinstance(got, Miss):
                assert got == chunk
            else:
                fresh_misses.append(got)
            if self.enforces_capacity:
                usage = tier.usage()
                assert usage.used_bytes <= usage.capacity_bytes <= self.capacity
        assert len(fresh_misses) <= len(keys) // 10, f"{len(fresh_misses)} just-written chunks missed"
        hits = [(v, c) for v, c in zip(tier.get(keys), chunks) if not isinstance(v, Miss)]
        assert all(v == c for v, c in hits)
        if self.enforces_capacity:
            assert 0 < len(hits) < len(keys)
        assert tier.check() == []

    def test_oversized_chunk_is_refused(self, make_tier: Factory) -> None:
        if not self.enforces_capacity:
            pytest.skip("this tier's bound lives in another process")
        tier = make_tier(self.capacity)
        key = key_of("huge")
        huge = chunk_for(key, tokens=self.capacity // 128 + 16)  # 128 payload bytes a token
        assert len(huge) > self.capacity
        assert tier.put([Entry(key, huge)]) == [False]
        assert tier.get([key]) == [Miss(ABSENT)]
        small = key_of("small")
        assert tier.put([Entry(small, chunk_for(small))]) == [True]
        assert tier.check() == []

    def test_eviction_is_labelled(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        keys = [key_of(f"ev{i}") for i in range(max(1, self.overfill // 2) * self.capacity // CHUNK)]
        for key in keys:
            assert tier.put([Entry(key, chunk_for(key))]) == [True]
        results = tier.get(keys)
        misses = [r for r in results if isinstance(r, Miss)]
        if self.enforces_capacity:
            assert misses, "puts past the capacity must evict something"
        allowed = {EVICTED} if self.reports_evicted else {EVICTED, ABSENT}
        assert {m.reason for m in misses} <= allowed
        for key, value in zip(keys, results):
            if not isinstance(value, Miss):
                assert value == chunk_for(key)
        first_miss = next((i for i, r in enumerate(results) if isinstance(r, Miss)), None)
        if first_miss is not None:
            probe = tier.probe(keys[first_miss:])
            assert probe.hits == 0 and probe.reason in allowed
        assert tier.check() == []

    # --- lifecycle and threads -------------------------------------------------------------
    def test_closed_tier_raises(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        key = key_of("closed")
        tier.put([Entry(key, chunk_for(key))])
        tier.close()
        tier.close()  # idempotent
        for call in (lambda: tier.probe([key]), lambda: tier.contains([key]), lambda: tier.get([key]),
                     lambda: tier.get_into([key], [memoryview(bytearray(CHUNK))]),
                     lambda: tier.put([Entry(key, chunk_for(key))]), lambda: tier.delete([key])):
            with pytest.raises(RuntimeError):
                call()

    def test_concurrent_put_get(self, make_tier: Factory) -> None:
        tier = make_tier(self.capacity)
        shared = [key_of(f"shared{i}") for i in range(12)]

        def worker(n: int) -> list[str]:
            """Random verbs; returns wrong-bytes findings (an exception fails the test)."""
            rng = random.Random(n)
            own = [key_of(f"t{n}-{i}") for i in range(10)]
            buf = memoryview(bytearray(CHUNK + 4096))
            errors = []
            for step in range(150):
                key = rng.choice(own + shared)
                action = rng.random()
                if action < 0.4:
                    tier.put([Entry(key, chunk_for(key))])
                elif action < 0.7:
                    value = tier.get([key])[0]
                    if not isinstance(value, Miss) and value != chunk_for(key):
                        errors.append(f"thread {n} step {step}: wrong bytes from get")
                elif action < 0.9:
                    res = tier.get_into([key], [buf])[0]
                    if not isinstance(res, Miss) and bytes(buf[:res]) != chunk_for(key):
                        errors.append(f"thread {n} step {step}: wrong bytes from get_into")
                elif action < 0.95:
                    tier.delete([key])
                else:
                    tier.contains([key, rng.choice(shared)])
            return errors

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(worker, n) for n in range(4)]
            errors = [e for f in futures for e in f.result(timeout=120)]  # re-raises a crash
        assert errors == []
        assert tier.check() == []
        if self.enforces_capacity:
            assert tier.usage().used_bytes <= self.capacity
        for key, value in zip(shared, tier.get(shared)):
            assert isinstance(value, Miss) or value == chunk_for(key)


__all__ = ["CHUNK", "NAMESPACE", "Tier", "TierContract", "chunk_for", "key_of"]

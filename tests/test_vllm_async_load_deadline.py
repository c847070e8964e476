"""An async restore whose store stalls is given up after ``async_load_timeout_s``: the request
stops waiting in WAITING_FOR_REMOTE_KVS (reported finished, every block failed, so vLLM
recomputes), the stuck read never writes into its blocks once given up, loads queued behind it
are given up with it, and loads while it is still stuck fail at once.

Before, a stalled tier held such a request (and every async load queued behind it on the one
async thread) for as long as the stall. The tier is the fault-injecting fake with its reads
throttled: its index answers at once, as a disk tier's does over a hung device.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

TIMEOUT_S, STALL_S = 0.4, 6.0  # bounds below leave a busy machine seconds of slack


def test_stalled_async_restore_is_given_up_and_never_writes_late(tmp_path: Path) -> None:
    from tests.test_vllm_connector_flow import C, N, _run_step, saved_on_faulty_tier
    from tests.vllm_halves import fake_request, scheduler_output

    with saved_on_faulty_tier(tmp_path, async_load="always", async_load_timeout_s=TIMEOUT_S) as saved:
        sched, worker, caches, tier, tokens, first = saved
        chunk_bytes = tier.usage().used_bytes // 3
        restored = 3 * C // N

        def queue(rid: str, blocks: list[int]) -> None:
            r = fake_request(rid, tokens[: 3 * C] + [1, 2, 3])
            hit, is_async = sched.get_num_new_matched_tokens(r, 0)
            assert hit == 3 * C and is_async
            sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)

        def finish(rids: set[str], bound_s: float) -> tuple[float, set[int], dict[str, Any]]:
            """Engine steps until ``rids`` finished receiving: (seconds, failed blocks, outcomes)."""
            t0, done, errors, outcomes = time.monotonic(), set(), set(), {}
            while not rids <= done:
                assert time.monotonic() - t0 < bound_s, f"{rids - done} still waiting"
                _, errs, out = _run_step(sched, worker, scheduler_output([], {}), caches)
                done |= set(out.finished_recving)
                errors |= errs
                if out.kv_connector_worker_meta is not None:
                    outcomes.update(out.kv_connector_worker_meta.loads)
                time.sleep(0.02)
            return time.monotonic() - t0, errors, outcomes

        tier.read_bytes_per_s = chunk_bytes * 3 / STALL_S  # the device stalls: ~STALL_S a read
        blocks2, blocks3 = list(range(10, 17)), list(range(20, 27))
        queue("r2", blocks2)
        queue("r3", blocks3)  # queued behind r2 on the async thread
        took, errors, outcomes = finish({"r2", "r3"}, STALL_S / 2)  # the deadline, not the stall
        assert errors == set(blocks2[:restored]) | set(blocks3[:restored])  # vLLM recomputes them
        assert {outcomes[r].reason for r in ("r2", "r3")} == {"timeout"}
        for t in caches.values():  # vLLM reuses the blocks: the late read must not touch them
            t[blocks2] = 7.0
            t[blocks3] = 7.0
        blocks4 = list(range(30, 37))
        queue("r4", blocks4)  # r2's read is still stuck in the store: no wait at all
        took, errors, _ = finish({"r4"}, STALL_S / 3)
        assert errors == set(blocks4[:restored]), took
        end = time.monotonic() + STALL_S + 15  # the stuck read returns (later on a busy machine)
        while worker.async_loads.stalled:
            assert time.monotonic() < end, "the stuck read never returned"
            time.sleep(0.1)
        time.sleep(0.2)
        for t in caches.values():
            assert bool((t[blocks2] == 7.0).all()) and bool((t[blocks3] == 7.0).all())
        tier.read_bytes_per_s = 0  # healthy again: a load restores the prefix exactly
        blocks5 = list(range(40, 47))
        queue("r5", blocks5)
        _, errors, _ = finish({"r5"}, 15)
        assert not errors
        for t in caches.values():
            assert torch.equal(t[blocks5[:restored]], t[first[:restored]])


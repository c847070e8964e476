"""A synchronous restore whose store stalls is given up after ``sync_load_timeout_s``: vLLM's
forward thread never waits longer, the stuck read never writes into the engine's blocks once
given up, and loads while it is still stuck fail at once instead of queueing behind it.

The tier is the fault-injecting fake with its reads throttled (probes answer at once, as a
disk tier's in-memory index does over a hung device). Found by an audit: the forward thread
was blocked for as long as the store stalled (16 s in its run).
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

TIMEOUT_S, STALL_S = 0.3, 6.0  # bounds below leave a busy machine seconds of slack


def test_stalled_sync_restore_is_given_up_and_never_writes_late(tmp_path: Path) -> None:
    from tests.test_vllm_connector_flow import C, N, _fill, _run_step, saved_on_faulty_tier
    from tests.vllm_halves import fake_request, scheduler_output

    with saved_on_faulty_tier(tmp_path, async_load="never", sync_load_timeout_s=TIMEOUT_S) as saved:
        sched, worker, caches, tier, tokens, first = saved
        chunk_bytes = tier.usage().used_bytes // 3
        tier.read_bytes_per_s = chunk_bytes * 3 / STALL_S  # the device stalls: ~STALL_S a read

        def load(rid: str, blocks: list[int]) -> tuple[float, set[int], Any]:
            r = fake_request(rid, tokens[: 3 * C] + [1, 2, 3])
            hit, is_async = sched.get_num_new_matched_tokens(r, 0)
            assert hit == 3 * C and not is_async
            sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)
            r.num_computed_tokens = hit
            t0 = time.monotonic()
            meta, errors, out = _run_step(sched, worker, scheduler_output([(r, blocks, hit)], {rid: 3}),
                                          caches, _fill(blocks[-1:], 9))
            return time.monotonic() - t0, errors, out

        blocks2 = list(range(10, 17))
        took, errors, out = load("r2", blocks2)
        assert took < STALL_S / 2, took  # the deadline, not the stall
        assert errors == set(blocks2[: 3 * C // N])  # vLLM recomputes them
        assert out.kv_connector_worker_meta.loads["r2"].reason == "timeout"
        for t in caches.values():  # vLLM reuses the blocks: the late read must not touch them
            t[blocks2] = 7.0
        blocks3 = list(range(20, 27))
        took, errors, _ = load("r3", blocks3)  # the layer thread is still stuck in the store
        assert took < STALL_S / 3 and errors == set(blocks3[: 3 * C // N]), took  # no wait at all
        time.sleep(STALL_S + 0.5)  # the stuck read returns
        for t in caches.values():
            assert bool((t[blocks2] == 7.0).all())
        # ... and the cost model timed it: it knows this tier is slow now (seconds per load).
        end = time.monotonic() + 15  # on a busy machine the stuck read returns later
        while (cpu := worker.costs.costs(time.monotonic()).tier("cpu")).age_s == 0:
            assert time.monotonic() < end, "the given-up read was never timed"
            time.sleep(0.1)
        assert cpu.fixed_s + cpu.s_per_byte * 3 * chunk_bytes > TIMEOUT_S
        tier.read_bytes_per_s = 0  # healthy again: a load restores the prefix exactly
        blocks4 = list(range(30, 37))
        _, errors, _ = load("r4", blocks4)
        assert not errors
        for t in caches.values():
            assert torch.equal(t[blocks4[: 3 * C // N]], t[first[: 3 * C // N]])


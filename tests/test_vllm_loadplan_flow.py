"""Load or recompute through both connector halves, no engine (the harness of
test_vllm_connector_flow.py): a real SchedulerSide asks a real WorkerSide over its socket, the
worker's store is one FaultyTier, and the worker's estimates are fed as an engine would feed them.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.test_vllm_connector_flow import (
    C,
    N,
    _fill,
    _halves,
    _output,
    _req,
    _run_step,
    _wait_saved,
)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def _setup(tmp_path: Path, **vllm: Any) -> tuple[Any, Any, Any, Any, list[int]]:
    from kvtier.store import TieredStore
    from tests.fakes import FaultyTier

    sched, worker, caches = _halves(tmp_path, **vllm)
    tier = FaultyTier(64 << 20, name="disk")
    worker.store = TieredStore([tier], metrics=worker.metrics)  # before any cache is bound
    tokens = list(range(9, 9 + 4 * C + 5))                      # 4 chunks + a tail
    r1 = _req("r1", tokens)
    sched.get_num_new_matched_tokens(r1, 0)
    blocks = list(range(1, 10))
    _run_step(sched, worker, _output([(r1, blocks, 0)], {"r1": len(tokens)}), caches, write=_fill(blocks, 3))
    _wait_saved(worker, 4)
    # The engine's prefill as the connector times it: 1,000 tokens in 10 ms.
    worker.costs.step_begin(1000, 0.0)
    worker.costs.step_end(0.01)
    return sched, worker, caches, tier, tokens


def test_slow_tier_is_skipped_and_counted(tmp_path: Path) -> None:
    sched, worker, caches, tier, tokens = _setup(tmp_path)
    try:
        chunk_bytes = worker.chunk_bytes
        # Measured: this tier reads 4 chunks in 2 s, recompute of 4 chunks takes ~1.3 ms.
        worker.costs.observe_load({"disk": 4}, 4 * chunk_bytes, 2.0, time.monotonic())
        r2 = _req("r2", tokens[: 4 * C] + [1, 2, 3])
        assert sched.get_num_new_matched_tokens(r2, 0) == (0, False)
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
        meta, _, _ = _run_step(sched, worker, _output([], {}), caches)
        assert meta.loads == [] and meta.skipped_tokens == 4 * C
        assert worker.prefetcher.get("r2") is None             # nothing read from the slow tier
        assert sched.request_finished(r2)[1]["kvtier"]["skipped_tokens"] == 4 * C
        stats = sched.get_stats()
        assert stats is not None and stats.data["load_skipped_tokens"] == 4 * C
        assert worker.metrics.registry.get_sample_value("kvtier_connector_load_skipped_tokens_total") == 4 * C
    finally:
        worker.shutdown()
        sched.shutdown()


def test_fast_tier_loads_the_full_prefix_inline(tmp_path: Path) -> None:
    sched, worker, caches, tier, tokens = _setup(tmp_path)
    try:
        # Not an in-memory tier, but measured fast: the whole hit, loaded synchronously
        # (a short load costs less inline than the engine steps an async one waits).
        worker.costs.observe_load({"disk": 4}, 4 * worker.chunk_bytes, 1e-4, time.monotonic())
        r2 = _req("r2", tokens[: 4 * C] + [1, 2, 3])
        hit, is_async = sched.get_num_new_matched_tokens(r2, 0)
        assert (hit, is_async) == (4 * C, False)
        blocks2 = list(range(20, 29))
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: (blocks2,)), hit)
        meta, errors, _ = _run_step(sched, worker, _output([], {}), caches)
        assert len(meta.loads) == 1 and not errors and meta.skipped_tokens == 0
        for t in caches.values():
            assert t[blocks2[: 4 * C // N]].abs().sum() > 0
        assert sched.request_finished(r2)[1]["kvtier"]["skipped_tokens"] == 0
    finally:
        worker.shutdown()
        sched.shutdown()


def test_long_load_from_a_lower_tier_stays_async(tmp_path: Path) -> None:
    # load_decision "always": the slow tier is loaded anyway, and off the forward path.
    sched, worker, caches, tier, tokens = _setup(tmp_path, load_decision="always")
    try:
        worker.costs.observe_load({"disk": 4}, 4 * worker.chunk_bytes, 0.5, time.monotonic())
        hit, is_async = sched.get_num_new_matched_tokens(_req("r2", tokens[: 4 * C] + [1]), 0)
        assert (hit, is_async) == (4 * C, True)
    finally:
        worker.shutdown()
        sched.shutdown()

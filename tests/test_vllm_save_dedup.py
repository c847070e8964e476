"""Each chunk is copied out of vLLM's blocks and written once, however many requests carry it.

Both connector halves wired together as in test_vllm_connector_flow.py (real SchedulerSide,
real WorkerSide with a real store, paged CPU tensors). The worker's copier is the real
``CpuCopier`` with two additions: it records which blocks each capture copied, and its
``end_capture`` fence can be held shut (as a device's slow D2H copy would), which keeps a
step's saves in flight while later steps run.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


class _GateFence:
    def __init__(self, gate: threading.Event) -> None:
        self.gate = gate

    def wait(self) -> None:
        self.gate.wait(30)

    def query(self) -> bool:
        return self.gate.is_set()


def _recording_copier(gate: threading.Event) -> Any:
    from kvtier_vllm.copier import CaptureIndex, CpuCopier, Fence

    class Recording(CpuCopier):
        def __init__(self) -> None:
            super().__init__(lambda: None)  # captures on a background thread, as in the worker
            self.captured: list[list[int]] = []  # block ids of each begin_capture, per step

        def begin_capture(self, block_ids: Sequence[int], per_chunk: int) -> CaptureIndex:
            self.captured.append(list(block_ids))
            return super().begin_capture(block_ids, per_chunk)

        def end_capture(self) -> Fence:
            super().end_capture()
            return _GateFence(gate)

    return Recording()


def _setup(tmp_path: Path, **vllm: Any) -> tuple[Any, Any, dict[str, torch.Tensor], Any, threading.Event]:
    from test_vllm_connector_flow import _halves

    sched, worker, caches = _halves(tmp_path, **vllm)
    gate = threading.Event()
    copier = _recording_copier(gate)
    worker.use_copier(copier)
    return sched, worker, caches, copier, gate


def _new(sched: Any, reqs: Sequence[tuple[Any, list[int]]]) -> Any:
    from test_vllm_connector_flow import _output

    for r, _ in reqs:
        sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    return _output([(r, ids, 0) for r, ids in reqs], {r.request_id: len(r.all_token_ids) for r, _ in reqs})


def _deduped(worker: Any) -> int:
    stats = worker.take_stats()
    return int(stats.reduce().get("save_deduped_chunks", 0)) if stats is not None else 0


def test_requests_sharing_a_prefix_in_one_step_capture_each_chunk_once(tmp_path: Path) -> None:
    from test_vllm_connector_flow import C, _fill, _req, _run_step, _wait_saved

    sched, worker, caches, copier, gate = _setup(tmp_path)
    gate.set()
    try:
        prefix = list(range(11, 11 + 2 * C))
        r1, r2 = _req("r1", prefix + list(range(900, 900 + C))), _req("r2", prefix + list(range(700, 700 + C)))
        b1, b2 = list(range(0, 6)), list(range(10, 16))  # vLLM computed the prefix for both
        write1, write2 = _fill(b1, 5), _fill(b2[4:], 6)

        def write(name: str, t: torch.Tensor) -> None:
            write1(name, t)
            t[b2[:4]] = t[b1[:4]]  # the same tokens give the same KV
            write2(name, t)

        meta, _, _ = _run_step(sched, worker, _new(sched, [(r1, b1), (r2, b2)]), caches, write=write)
        assert [(s.req_id, s.start_chunk, s.end_chunk) for s in meta.saves] == [("r1", 0, 3), ("r2", 0, 3)]
        # r1 took all three of its chunks; r2 only its own third chunk (2 blocks per chunk).
        assert copier.captured == [b1, b2[4:]]
        assert _deduped(worker) == 2
        _wait_saved(worker, 4)
        keys = worker.cache_for(b"").keys(r2.all_token_ids, full_chunks_only=True)
        assert worker.store.tiers[0].probe(keys).hits == 3  # r2's whole prompt is stored
        assert len(worker.inflight) == 0
    finally:
        worker.shutdown()
        sched.shutdown()


def test_chunks_in_flight_from_an_earlier_step_are_not_captured_again(tmp_path: Path) -> None:
    from test_vllm_connector_flow import C, _fill, _req, _run_step, _wait_saved

    sched, worker, caches, copier, gate = _setup(tmp_path)
    try:
        prefix = list(range(40, 40 + 2 * C))
        r1, r2 = _req("r1", prefix + [1, 2, 3]), _req("r2", prefix + list(range(300, 300 + C)))
        _run_step(sched, worker, _new(sched, [(r1, [1, 2, 3, 4, 5])]), caches, write=_fill([1, 2, 3, 4, 5], 1))
        assert len(worker.inflight) == 2 and worker.store.tiers[0].usage().entries == 0  # held
        b2 = [20, 21, 22, 23, 24, 25]
        _run_step(sched, worker, _new(sched, [(r2, b2)]), caches, write=_fill(b2, 2))
        assert copier.captured == [[1, 2, 3, 4], b2[4:]]  # r2: only the chunk nobody holds
        assert _deduped(worker) == 2
        gate.set()
        _wait_saved(worker, 3)
        end = time.monotonic() + 10
        while len(worker.inflight) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(worker.inflight) == 0  # released once written

        # Stored now: a third request computing the same prefix does not capture it either.
        r3 = _req("r3", prefix + list(range(500, 500 + C)))
        b3 = [30, 31, 32, 33, 34, 35]
        _run_step(sched, worker, _new(sched, [(r3, b3)]), caches, write=_fill(b3, 3))
        assert copier.captured[-1] == b3[4:] and _deduped(worker) == 2
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_dropped_write_releases_its_chunks_for_a_later_request(tmp_path: Path) -> None:
    from test_vllm_connector_flow import C, _fill, _req, _run_step, _wait_saved

    sched, worker, caches, copier, gate = _setup(tmp_path, save_queue_depth=1)
    try:
        r1, r2 = _req("r1", list(range(1000, 1000 + C))), _req("r2", list(range(2000, 2000 + C)))
        shared = list(range(3000, 3000 + C))
        r3 = _req("r3", shared)
        for r, ids in ((r1, [1, 2]), (r2, [3, 4]), (r3, [5, 6])):
            _run_step(sched, worker, _new(sched, [(r, ids)]), caches, write=_fill(ids, ids[0]))
            end = time.monotonic() + 10  # r1's job taken by the saver (on a busy machine: later)
            while r is r1 and worker.saver._queue.qsize() and time.monotonic() < end:
                time.sleep(0.01)
        # The saver waits on r1's fence, r2's job fills the queue: r3's job was dropped.
        stats = worker.take_stats()
        assert stats is not None and stats.reduce()["save_dropped"] == 1
        gate.set()
        _wait_saved(worker, 2)
        end = time.monotonic() + 10
        while len(worker.inflight) and time.monotonic() < end:
            time.sleep(0.01)
        assert len(worker.inflight) == 0
        key = worker.cache_for(b"").keys(shared, full_chunks_only=True)
        assert worker.store.tiers[0].probe(key).hits == 0  # r3's chunk was not written

        r4 = _req("r4", shared + [7, 7, 7])  # the same chunk, computed again
        _run_step(sched, worker, _new(sched, [(r4, [7, 8, 9])]), caches, write=_fill([7, 8, 9], 7))
        assert copier.captured[-1] == [7, 8]
        _wait_saved(worker, 3)
        assert worker.store.tiers[0].probe(key).hits == 1
    finally:
        worker.shutdown()
        sched.shutdown()


def test_background_capture_ends_before_wait_for_save_returns() -> None:
    """The CPU copier captures on its own thread while later layers compute; ``end_capture``
    must not return before those copies ran (the next step may overwrite the blocks)."""
    from kvtier_vllm.blocks import detect_layout, kv_views
    from kvtier_vllm.copier import CpuCopier

    layers, blocks, heads, n, d = 3, 8, 2, 16, 8
    caches = [torch.randn(blocks, heads, n, 2 * d) for _ in range(layers)]
    layout = detect_layout(caches[0], backend="CPU_ATTN", block_size=n, num_kv_heads=heads, head_dim=d, isa="vec")
    views = [kv_views(c, layout) for c in caches]
    copier = CpuCopier(lambda: time.sleep(0.3))  # a capture thread slow to start
    index = copier.begin_capture([5, 2], 2)
    out = torch.empty(layers, 2, 2 * n, heads, d)
    expect = []
    for layer in range(layers):
        copier.capture_layer(views[layer], layer, [(index, [out[layer]])])
        expect.append(torch.cat([views[layer][p][[5, 2]].reshape(2 * n, heads, d)[None] for p in range(2)]))
    copier.end_capture()
    for c in caches:
        c.zero_()  # what the next step may do to these blocks
    for layer in range(layers):
        assert torch.equal(out[layer], expect[layer]), layer

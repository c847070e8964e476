"""The worker's GPU path without a GPU: the real WorkerSide and SchedulerSide (as in
tests/test_vllm_connector_flow.py) with the DeviceCopier on the simulated device, the engine's
forward writing on the simulated compute stream; plus the bounded staging pool, saves that
never raise into the engine, MLA latent caches, and piecewise CUDA graphs.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.blocks import detect_layout, kv_views
from kvtier_vllm.copier import CpuCopier, RestoreItem
from kvtier_vllm.devcopier import DeviceCopier
from kvtier_vllm.simdevice import SimDevice
from kvtier_vllm.staging import StagingPool

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")


def _on_sim(worker: Any, caches: dict[str, torch.Tensor], seed: int,
            restore_bytes: int | None = None) -> SimDevice:
    """Move a registered worker onto the simulated device (its caches become device memory)."""
    sim = SimDevice(seed=seed, max_delay_s=0.002)
    sim.set_current(sim.compute)
    for t in caches.values():
        sim.device_tensor(t)
    worker.use_copier(DeviceCopier(sim), restore_bytes=restore_bytes)
    return sim


def _compute_fill(sim: SimDevice, blocks: list[int], seed: int) -> Any:
    from test_vllm_connector_flow import _fill

    fill = _fill(blocks, seed)

    def write(name: str, t: torch.Tensor) -> None:
        sim.launch(sim.compute, lambda: time.sleep(0.004))   # the GPU runs behind the host
        sim.launch(sim.compute, lambda: fill(name, t))

    return write


@needs_vllm
@pytest.mark.parametrize(("async_load", "seed", "restore_pool"),
                         [(a, seed, "pinned") for a in ("never", "always") for seed in range(3)]
                         + [("never", 0, "exhausted"), ("always", 1, "exhausted")])
def test_worker_saves_and_restores_exactly_on_the_simulated_device(tmp_path: Path, async_load: str,
                                                                   seed: int, restore_pool: str) -> None:
    from test_vllm_connector_flow import _halves, _output, _req, _run_step, _wait_saved

    sched, worker, caches = _halves(tmp_path, async_load=async_load)
    # "exhausted": a restore pool with no slot, so restores fall back to pageable bytes.
    sim = _on_sim(worker, caches, seed, restore_bytes=0 if restore_pool == "exhausted" else None)
    try:
        from test_vllm_connector_flow import _fill

        fill = _fill(blocks1 := [10, 3, 40, 22, 5, 6], 100 + seed)
        N, C = worker.info.block_size, worker.chunk
        tokens = list(range(7, 7 + 5 * N + 3))
        r1 = _req("r1", tokens)
        sched.get_num_new_matched_tokens(r1, 0)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
        _run_step(sched, worker, _output([(r1, blocks1, 0)], {"r1": len(tokens)}), caches,
                  write=_compute_fill(sim, blocks1, 100 + seed))
        # r1 finishes; the next step's forward reuses its blocks at once.
        for t in caches.values():
            sim.launch(sim.compute, lambda t=t: t.index_fill_(0, torch.tensor(blocks1), -1.0))
        _wait_saved(worker, 2)
        r2 = _req("r2", tokens[: 4 * N] + [1, 2, 3])
        hit, is_async = sched.get_num_new_matched_tokens(r2, 0)
        assert hit == 2 * C and is_async == (async_load == "always")
        blocks2 = [50, 51, 12, 13, 14]
        # The blocks handed to r2 still have a zeroing queued on the compute stream, far behind
        # (the restore must wait for it, not be clobbered by it).
        sim.launch(sim.compute, lambda: time.sleep(0.1))
        for t in caches.values():
            sim.launch(sim.compute, lambda t=t: t.index_fill_(0, torch.tensor(blocks2), 0.0))
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: (blocks2,)), hit)
        meta, errors, out = _run_step(sched, worker, _output([], {}), caches)
        assert len(meta.loads) == 1 and not errors
        if is_async:
            end = time.monotonic() + 10
            done = set(out.finished_recving)
            while "r2" not in done and time.monotonic() < end:
                time.sleep(0.01)
                done |= worker.finished(set())
            assert "r2" in done and not worker.take_errors()
        sim.synchronize()
        for name, t in caches.items():
            want = torch.zeros_like(t)
            fill(name, want)   # what r1's forward wrote
            assert torch.equal(t[blocks2[:4]], want[blocks1[:4]]), name
        # Every copy (captures, indices, restores) came from pinned memory, unless the restore
        # pool was exhausted: then the 2 restored chunks were pageable, and counted.
        stats = worker.stats.take()
        assert stats is not None
        pageable = 2 if restore_pool == "exhausted" else 0
        assert stats.reduce()["load_pageable_chunks"] == pageable
        assert (sim.pageable_copies > 0) == bool(pageable)
        assert worker.restore_bufs.pool.free == worker.restore_bufs.pool.slots  # all slots back
    finally:
        worker.shutdown()
        sched.shutdown()
        sim.close()


@needs_vllm
def test_a_full_staging_pool_saves_the_leading_chunks_and_counts_the_rest(tmp_path: Path) -> None:
    from test_vllm_connector_flow import _fill, _halves, _output, _req, _run_step, _wait_saved

    sched, worker, caches = _halves(tmp_path)
    worker.use_copier(worker.copier, staging_bytes=worker.pool.slot_bytes)  # room for one chunk
    try:
        N, C = worker.info.block_size, worker.chunk
        tokens = list(range(7, 7 + 4 * N))
        r1 = _req("r1", tokens)
        sched.get_num_new_matched_tokens(r1, 0)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
        _run_step(sched, worker, _output([(r1, [1, 2, 3, 4], 0)], {"r1": len(tokens)}), caches,
                  write=_fill([1, 2, 3, 4], 5))
        _wait_saved(worker, 1)
        end = time.monotonic() + 10
        while worker.pool.free < 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert worker.pool.free == 1
        stats = worker.stats.take()
        assert stats is not None and stats.reduce()["save_dropped"] == 1 and stats.reduce()["save_chunks"] == 1
        assert worker.store.tiers[0].usage().entries == 1
        assert sched.get_num_new_matched_tokens(_req("r2", tokens + [9]), 0)[0] == C
    finally:
        worker.shutdown()
        sched.shutdown()


class _FailingCapture(CpuCopier):
    """Fault injection: the device runs out of memory inside save_kv_layer."""

    def capture_layer(self, views: Any, layer: int, jobs: Any) -> None:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")


@needs_vllm
def test_a_failing_capture_never_reaches_the_engine(tmp_path: Path) -> None:
    from test_vllm_connector_flow import _fill, _halves, _output, _req, _run_step

    sched, worker, caches = _halves(tmp_path)
    worker.use_copier(_FailingCapture())
    try:
        tokens = list(range(7, 7 + 4 * worker.info.block_size))
        r1 = _req("r1", tokens)
        sched.get_num_new_matched_tokens(r1, 0)
        sched.update_state_after_alloc(r1, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
        _run_step(sched, worker, _output([(r1, [1, 2, 3, 4], 0)], {"r1": len(tokens)}), caches,
                  write=_fill([1, 2, 3, 4], 5))  # raises nothing
        end = time.monotonic() + 10
        while worker.pool.free < worker.pool.slots and time.monotonic() < end:
            time.sleep(0.01)
        assert worker.pool.free == worker.pool.slots  # the slots came back
        stats = worker.stats.take()
        assert stats is not None and {k: v for k, v in stats.reduce().items() if k.startswith("failures_by_reason")} == {"failures_by_reason[save_error]": 1}
        assert worker.store.tiers[0].usage().entries == 0
    finally:
        worker.shutdown()
        sched.shutdown()


def test_staging_pool_is_bounded_and_hands_out_each_slot_once() -> None:
    pool = StagingPool(3 * 2 * 2 * 8 * 4 * 2 + 5, (2, 2, 8, 4), torch.float16, lambda n: torch.zeros(n, dtype=torch.uint8))
    assert pool.slots == 3
    a = pool.take(2)
    b = pool.take(2)
    assert len(a) == 2 and len(b) == 1 and not set(a) & set(b) and pool.take(1) == []
    pool.tensor(a[0]).fill_(1.0)
    assert float(pool.tensor(b[0]).sum()) == 0.0   # slots do not overlap
    pool.give(a + b)
    assert pool.free == 3
    assert StagingPool(10, (2, 2, 8, 4), torch.float16, lambda n: torch.zeros(n, dtype=torch.uint8)).slots == 0


@pytest.mark.parametrize("shape", ["flat", "one_head"])
def test_mla_latent_is_one_plane_and_round_trips_on_both_copiers(shape: str) -> None:
    from kvtier_vllm.blocks import heads_dim as _heads_dim

    B, N, W = 12, 4, 576
    def make() -> torch.Tensor:
        return torch.zeros(B, N, W) if shape == "flat" else torch.zeros(B, 1, N, W)
    t = make()
    assert _heads_dim(tuple(t.shape), N, mla=True) == (1, W)
    layout = detect_layout(t, backend="FLASHMLA", block_size=N, num_kv_heads=1, head_dim=W, mla=True)
    assert layout.kind == "mla" and layout.planes == 1 and layout.block_elems == N * W
    with pytest.raises(ValueError, match="MLA"):
        detect_layout(torch.zeros(B, N, W + 2), backend="FLASHMLA", block_size=N, num_kv_heads=1,
                      head_dim=W, mla=True)
    payload = torch.randn(2, 1, 2 * N, 1, W)  # (layers, 1 plane, tokens, 1 head, latent)
    ids = [7, 2]
    items = [RestoreItem(payload, 0, 2 * N, ids)]
    want = payload[:, 0, :, 0].reshape(2, 2, N, W)
    cpu = [make(), make()]
    CpuCopier().restore_blocking([kv_views(x, layout) for x in cpu], items)
    sim = SimDevice(seed=1)
    try:
        sim.set_current(sim.compute)
        dev = [sim.device_tensor(make()), sim.device_tensor(make())]
        copier = DeviceCopier(sim)
        copier.restore_blocking([kv_views(x, layout) for x in dev], items, copier.order_async())
        out = [sim.pinned((2, 1, 2 * N, 1, W), torch.float32)]
        cap = copier.begin_capture(ids, 2)
        for layer in range(2):
            copier.capture_layer(kv_views(dev[layer], layout), layer, [(cap, [out[0][layer]])])
        copier.end_capture().wait()
        sim.synchronize()
        assert torch.equal(out[0], payload)
    finally:
        sim.close()
    for got in (cpu, dev):
        for layer in range(2):
            blocks = got[layer].reshape(B, N, W)[ids]
            assert torch.equal(blocks, want[layer])


@needs_vllm
def test_layerwise_connector_asks_for_piecewise_cuda_graphs() -> None:
    from kvtier_vllm.connector import KVTierConnector

    assert KVTierConnector.requires_piecewise_for_cudagraph({})
    assert KVTierConnector.requires_piecewise_for_cudagraph({"vllm": {"load": False}})
    assert not KVTierConnector.requires_piecewise_for_cudagraph({"vllm": {"load": False, "save": False}})


def test_staging_slots_never_straddle_two_host_registrations() -> None:
    """The CUDA staging buffers are registered with cudaHostRegister piece by piece; a slot
    over two pieces is not pinned memory to a copy (the driver stages it, and a D2H capture
    then blocks the forward thread). The check reads the registration plan the region keeps,
    so it runs without CUDA: a 2 GiB save pool (the default size) with header-framed slots."""
    from kvtier_vllm.device import CudaDevice

    from kvtier.chunk import HEADER_SIZE

    dev = CudaDevice(torch.device("cuda"))
    shape = (32, 2, 256, 8, 128)  # a Llama-3-8B chunk of 256 tokens: 32 MiB, slots of 32 MiB + 4 KiB
    pool = StagingPool(2 << 30, shape, torch.float16, dev.host_buffer, head=HEADER_SIZE)
    region = dev._regions[-1]
    assert pool.slots > 32 and pool.slot_bytes % (1 << 20)
    base = int(__import__("numpy").frombuffer(region.view, dtype="uint8").ctypes.data)
    for s in range(pool.slots):
        lo = pool.raw(s).data_ptr() - base
        hi = lo + pool.slot_bytes
        assert any(off <= lo and hi <= off + size for off, size in region.pieces), f"slot {s} straddles"
    region.close()


@pytest.mark.parametrize("align", [1, 4096, 5000, 3 << 20, (1 << 30) + 4096])
def test_host_registration_pieces_are_page_aligned_and_hold_whole_slots(align: int) -> None:
    """A piece boundary inside a page registers that page twice (cudaHostRegister refuses the
    second piece and the whole region stays pageable); one inside a slot splits the slot."""
    import mmap

    from kvtier.pinned import registration_pieces

    nbytes = 5 * (1 << 30) + 12345
    pieces = registration_pieces(nbytes, align)
    assert pieces[0][0] == 0 and sum(size for _, size in pieces) == nbytes
    for (off, size), (nxt, _) in zip(pieces, pieces[1:]):
        assert off + size == nxt and nxt % mmap.PAGESIZE == 0 and nxt % align == 0

"""The device copier's stream ordering, proved on the simulated asynchronous device.

``DeviceCopier`` runs unchanged on ``SimDevice`` (each stream a thread with random delays, events
complete only when their stream reaches them). The engine's side is played by work enqueued on
the simulated compute stream, behind a random backlog (a GPU runs behind its host thread): block
zeroing, a preempted block rewritten, the forward writing and reading a layer's KV, the next
step overwriting captured blocks. Every assertion is byte-exact, over many seeds; each ordering
R1-R3, C1-C3 (devcopier.py) has a test that fails when that one wait is removed.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.blocks import Views, detect_layout, gather_layer, kv_views
from kvtier_vllm.copier import CaptureIndex, RestoreItem
from kvtier_vllm.devcopier import DeviceCopier
from kvtier_vllm.simdevice import SimDevice

from kvtier.prefetch import LayerPipeline

L, B, N, H, D = 3, 24, 4, 2, 8   # layers, blocks, block tokens, kv heads, head dim
C = 2 * N                         # chunk tokens: two blocks
SEEDS = range(24)
DT = torch.float16


class Engine:
    """A simulated GPU engine: paged KV caches in simulated device memory, a compute stream
    the calling (forward) thread owns, and a copier on the same device."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dev = SimDevice(seed=seed, max_delay_s=0.002)
        self.dev.set_current(self.dev.compute)
        base = [self.dev.zeros((B, N, H, 2 * D), DT) for _ in range(L)]
        self.caches = [t.permute(0, 2, 1, 3) for t in base]  # NHD in memory, [B, H, N, 2D]
        self._base = base
        layout = detect_layout(self.caches[0], backend="FLASH_ATTN", block_size=N,
                               num_kv_heads=H, head_dim=D)
        self.layout = layout
        self.views: list[Views] = [kv_views(t, layout) for t in self.caches]
        self.copier = DeviceCopier(self.dev)

    def compute(self, fn: Callable[[], None], backlog_s: float = 0.006) -> None:
        """Enqueue ``fn`` on the compute stream behind a random backlog of earlier kernels."""
        delay = self.rng.random() * backlog_s
        self.dev.launch(self.dev.compute, lambda: time.sleep(delay))
        self.dev.launch(self.dev.compute, fn)

    def fill_blocks(self, blocks: list[int], value: float | None, layers: range = range(L)) -> None:
        """Compute-stream write of ``blocks`` (``None``: random data the test can read back)."""
        planes = [(layer, torch.randn(len(blocks), H, N, 2 * D, generator=self.gen).to(DT)
                   if value is None else None) for layer in layers]

        def write() -> None:
            for layer, data in planes:
                if data is None:
                    self.caches[layer][blocks] = value
                else:
                    self.caches[layer][blocks] = data

        self.compute(write)

    def snapshot(self, layer: int, blocks: list[int]) -> Callable[[], torch.Tensor]:
        """A compute-stream read (the forward's attention): what the layer sees at that point."""
        out: list[torch.Tensor] = []
        self.compute(lambda: out.append(self.canonical(layer, blocks)))
        return lambda: out[0]

    def canonical(self, layer: int, blocks: list[int]) -> torch.Tensor:
        ref = torch.empty(2, len(blocks) * N, H, D, dtype=DT)
        gather_layer(self.views[layer], blocks, ref)
        return ref

    def payloads(self, n: int, pinned: bool) -> list[torch.Tensor]:
        out = []
        for _ in range(n):
            p = torch.randn(L, 2, C, H, D, generator=self.gen).to(DT)
            if pinned:
                q = self.dev.pinned(p.shape, DT)
                q.copy_(p)
                p = q
            out.append(p)
        return out

    def close(self) -> None:
        self.dev.close()


def _blocks(rng: random.Random, n: int) -> list[int]:
    return rng.sample(range(B), n)


def _items(payloads: list[torch.Tensor], blocks: list[int]) -> list[RestoreItem]:
    per = C // N
    return [RestoreItem(p, 0, C, blocks[i * per:(i + 1) * per]) for i, p in enumerate(payloads)]


def _expected(payloads: list[torch.Tensor], layer: int) -> torch.Tensor:
    return torch.cat([p[layer] for p in payloads], dim=1)


def _layerwise_restore(eng: Engine, items: list[RestoreItem], blocks: list[int], *,
                       wait_layers: bool) -> list[Callable[[], torch.Tensor]]:
    """The worker's sync-load protocol: begin on the forward thread, restore on a loader thread,
    per-layer waits (or none), reads of each layer by the forward, then finish."""
    copier = eng.copier
    pipe = LayerPipeline(name="sim-loader")
    plan: list[object] = []
    copier.begin_restore(L)
    run = pipe.start(L, lambda layer: copier.restore_layer(eng.views[layer], layer, plan[0]),  # type: ignore[arg-type]
                     lambda: plan.append(copier.prepare_restore(items)))
    reads = []
    for layer in range(L):
        if wait_layers:
            assert run.wait(layer, 30)
            copier.layer_ready(layer)
            reads.append(eng.snapshot(layer, blocks))
    run.join()
    copier.finish_restore()
    pipe.close()
    return reads


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("seed", SEEDS)
def test_layer_reads_see_the_restore_and_pending_zeroing_never_clobbers_it(seed: int, pinned: bool) -> None:
    # R1 (zeroing / a preempted block's old writes pending on the compute stream) and R2.
    eng = Engine(seed)
    try:
        blocks = _blocks(eng.rng, 6)
        payloads = eng.payloads(3, pinned)
        eng.fill_blocks(blocks, None)   # a preempted request's writes to blocks now handed over
        eng.fill_blocks(blocks, 0.0)    # the scheduler's zeroing of the new blocks
        reads = _layerwise_restore(eng, _items(payloads, blocks), blocks, wait_layers=True)
        after = [eng.snapshot(layer, blocks) for layer in range(L)]
        eng.dev.synchronize()
        for layer in range(L):
            want = _expected(payloads, layer)
            assert torch.equal(reads[layer](), want), f"layer {layer} read before its restore landed"
            assert torch.equal(after[layer](), want), f"layer {layer} restore was clobbered"
        if not pinned:
            assert eng.dev.pageable_copies == 2 * L * len(payloads)
        else:
            assert eng.dev.pageable_copies == 0
    finally:
        eng.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_finish_restore_orders_the_next_step_after_layers_nobody_waited_for(seed: int) -> None:
    # R2's second half: a step whose forward never called wait_for_layer_load.
    eng = Engine(seed)
    try:
        blocks = _blocks(eng.rng, 4)
        payloads = eng.payloads(2, pinned=True)
        _layerwise_restore(eng, _items(payloads, blocks), blocks, wait_layers=False)
        reads = [eng.snapshot(layer, blocks) for layer in range(L)]
        eng.dev.synchronize()
        for layer in range(L):
            assert torch.equal(reads[layer](), _expected(payloads, layer))
    finally:
        eng.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_async_restore_waits_for_compute_work_enqueued_before_it_started(seed: int) -> None:
    # R3: the event is taken on the forward thread; the async thread's own current stream
    # would order nothing.
    eng = Engine(seed)
    try:
        blocks = _blocks(eng.rng, 4)
        payloads = eng.payloads(2, pinned=True)
        eng.fill_blocks(blocks, None)
        eng.fill_blocks(blocks, 0.0)
        after = eng.copier.order_async()
        errors: list[BaseException] = []

        def load() -> None:
            try:
                eng.copier.restore_blocking(eng.views, _items(payloads, blocks), after)
            except BaseException as exc:  # noqa: BLE001 - re-raised below on the test thread
                errors.append(exc)

        t = threading.Thread(target=load, name="sim-async-load")
        t.start()
        t.join(30)
        assert not errors, errors
        # vLLM hears "finished" only now; the next step's reads come after.
        reads = [eng.snapshot(layer, blocks) for layer in range(L)]
        eng.dev.synchronize()
        for layer in range(L):
            assert torch.equal(reads[layer](), _expected(payloads, layer))
    finally:
        eng.close()


def _capture_step(eng: Engine, jobs: list[list[int]], overwrite_after: bool) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """One step with saves: the forward writes each layer's KV then save_kv_layer captures it;
    wait_for_save ends the capture; the next step overwrites the same blocks. Returns the
    staged chunks as the saver thread sees them after the fence, and what was written."""
    copier = eng.copier
    per = C // N
    staging = [[eng.dev.pinned((L, 2, C, H, D), DT) for _ in range(len(ids) // per)] for ids in jobs]
    indices: list[CaptureIndex] = [copier.begin_capture(ids, per) for ids in jobs]
    for layer in range(L):
        for ids in jobs:
            eng.fill_blocks(ids, None, range(layer, layer + 1))  # the forward writes this layer
        copier.capture_layer(eng.views[layer], layer,
                             [(ix, [t[layer] for t in st]) for ix, st in zip(indices, staging)])
    fence = copier.end_capture()
    # What the forward wrote, read in compute-stream order right after the capture.
    truth = [[eng.snapshot(layer, ids) for layer in range(L)] for ids in jobs]
    if overwrite_after:
        for ids in jobs:
            eng.fill_blocks(ids, -1.0, range(L))  # the next step reuses the blocks
    seen: list[list[torch.Tensor]] = []

    def saver() -> None:
        fence.wait()
        seen.extend([[t.clone() for t in st] for st in staging])

    t = threading.Thread(target=saver, name="sim-saver")
    t.start()
    t.join(30)
    eng.dev.synchronize()
    want = [[truth[j][layer]() for layer in range(L)] for j in range(len(jobs))]
    return seen, want


def _check_capture(seen: list[list[torch.Tensor]], want: list[list[torch.Tensor]]) -> None:
    per = C // N
    for j, chunks in enumerate(seen):
        for c, chunk in enumerate(chunks):
            for layer in range(L):
                exp = want[j][layer][:, c * per * N:(c + 1) * per * N]
                assert torch.equal(chunk[layer], exp), f"job {j} chunk {c} layer {layer} differs"


@pytest.mark.parametrize("seed", SEEDS)
def test_capture_sees_the_layer_written_before_it_and_not_the_writes_after(seed: int) -> None:
    # C1 (the gather follows the forward's write of the layer), C2 (the next step's writes
    # follow the gathers), C3 (the saver's fence covers the device-to-host copies).
    eng = Engine(seed)
    try:
        ids = _blocks(eng.rng, 8)
        seen, want = _capture_step(eng, [ids[:4], ids[4:]], overwrite_after=True)
        _check_capture(seen, want)
    finally:
        eng.close()


def test_the_simulated_device_catches_a_missing_wait() -> None:
    """Control: the same step with no event between the compute stream and a side stream
    goes wrong for some seed, so the tests above can fail."""
    bad = 0
    for seed in SEEDS:
        dev = SimDevice(seed=seed)
        try:
            dev.set_current(dev.compute)
            side = dev.new_stream()
            t = dev.zeros((4,), torch.float32)
            dev.launch(dev.compute, lambda: time.sleep(0.003 * (seed % 3)))
            dev.launch(dev.compute, lambda: t.fill_(1.0))
            dev.launch(side, lambda: t.add_(1.0))   # should have waited for the fill
            dev.synchronize()
            bad += int(not torch.equal(t, torch.full((4,), 2.0)))
        finally:
            dev.close()
    assert bad > 0


def test_pageable_copies_block_and_pinned_copies_do_not() -> None:
    dev = SimDevice(seed=1, max_delay_s=0.0)
    try:
        s = dev.new_stream()
        d = dev.zeros((8,), torch.float32)
        gate = threading.Event()
        dev.launch(s, lambda: gate.wait(5))        # the stream is busy until the gate opens
        pinned = dev.pinned((8,), torch.float32)
        pinned.fill_(3.0)
        t0 = time.perf_counter()
        dev.copy(d, pinned, s)                     # returns at once
        assert time.perf_counter() - t0 < 1.0 and dev.pageable_copies == 0
        threading.Timer(0.2, gate.set).start()
        t0 = time.perf_counter()
        dev.copy(d, torch.full((8,), 5.0), s)      # pageable: returns after the copy ran
        assert time.perf_counter() - t0 >= 0.15
        assert torch.equal(d, torch.full((8,), 5.0)) and dev.pageable_copies == 1
        with pytest.raises(ValueError, match="two host tensors"):
            dev.copy(torch.empty(2), torch.empty(2), s)
    finally:
        dev.close()

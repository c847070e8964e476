"""One set of copier scenarios, run on the simulated device (CI) and on CUDA (``-m gpu``).

``Engine`` plays vLLM's side of a GPU worker: paged KV caches in device memory, a compute stream
the calling (forward) thread owns, and a ``DeviceCopier`` on the same device. Compute-stream work
sits behind a random backlog (``time.sleep`` on the simulated stream, ``torch.cuda._sleep`` on a
GPU), because a GPU runs behind its host thread: that backlog is what makes a missing wait give
wrong bytes. Each scenario asserts byte-exact results against values computed on the host.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.blocks import Views, detect_layout, gather_layer, kv_views
from kvtier_vllm.copier import CaptureIndex, RestoreItem
from kvtier_vllm.devcopier import DeviceCopier
from kvtier_vllm.device import CudaDevice, Device
from kvtier_vllm.simdevice import SimDevice

from kvtier.prefetch import LayerPipeline

L, B, N, H, D = 3, 24, 4, 2, 8   # layers, blocks, block tokens, kv heads, head dim
C = 2 * N                         # chunk tokens: two blocks
DT = torch.float16
GPU_BACKLOG_CYCLES = 20_000_000   # ~10 ms of torch.cuda._sleep on a ~2 GHz GPU


class Engine:
    def __init__(self, kind: str, seed: int) -> None:
        self.kind = kind
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.dev: Device
        if kind == "sim":
            sim = SimDevice(seed=seed, max_delay_s=0.002)
            sim.set_current(sim.compute)
            self.sim: SimDevice | None = sim
            self.dev = sim
            base = [sim.zeros((B, N, H, 2 * D), DT) for _ in range(L)]
        else:
            self.sim = None
            self.dev = CudaDevice(torch.device("cuda"))
            base = [torch.zeros(B, N, H, 2 * D, dtype=DT, device="cuda") for _ in range(L)]
        self._base = base
        self.caches = [t.permute(0, 2, 1, 3) for t in base]  # NHD in memory, [B, H, N, 2D]
        self.layout = detect_layout(self.caches[0], backend="FLASH_ATTN", block_size=N,
                                    num_kv_heads=H, head_dim=D)
        self.views: list[Views] = [kv_views(t, self.layout) for t in self.caches]
        self.copier = DeviceCopier(self.dev)

    # --- the engine's compute stream --------------------------------------------------------------
    def compute(self, fn: Callable[[], None], backlog: float = 1.0) -> None:
        """Run ``fn`` as compute-stream work behind a random backlog of earlier kernels."""
        x = self.rng.random() * backlog
        if self.sim is not None:
            self.dev.launch(self.dev.current_stream(), lambda: time.sleep(0.006 * x))
            self.dev.launch(self.dev.current_stream(), fn)
        else:
            torch.cuda._sleep(int(GPU_BACKLOG_CYCLES * x))
            fn()  # torch ops on the forward thread's current stream

    def slow(self, stream: object) -> None:
        """A random backlog on a side stream (earlier jobs still running on it)."""
        x = self.rng.random()
        if self.sim is not None:
            self.dev.launch(stream, lambda: time.sleep(0.006 * x))
        else:
            self.dev.launch(stream, lambda: torch.cuda._sleep(int(GPU_BACKLOG_CYCLES * x)))

    def hold(self, stream: object) -> Callable[[], None]:
        """Keep ``stream`` busy until the returned callable is called (a GPU: ~0.5 s at most)."""
        if self.sim is not None:
            gate = threading.Event()
            self.dev.launch(stream, lambda: gate.wait(10))
            return gate.set
        self.dev.launch(stream, lambda: torch.cuda._sleep(1_000_000_000))
        return lambda: None

    def fill_blocks(self, blocks: list[int], value: float | None, layers: range = range(L),
                    backlog: float = 1.0) -> list[torch.Tensor]:
        """Compute-stream write of ``blocks``: ``value``, or random data (a forward writing KV).
        Returns what each layer's blocks hold afterwards, canonical ``[2, n*N, H, D]``."""
        host = [torch.randn(len(blocks), H, N, 2 * D, generator=self.gen).to(DT) for _ in layers]
        if value is not None:
            host = [torch.full_like(d, value) for d in host]
        data = host if self.sim is not None else [d.cuda() for d in host]
        idx = self._idx(blocks)

        def write() -> None:
            for layer, d in zip(layers, data):
                self.caches[layer][idx] = d

        self.compute(write, backlog)
        return [torch.stack([d[..., :D].permute(0, 2, 1, 3), d[..., D:].permute(0, 2, 1, 3)])
                .reshape(2, len(blocks) * N, H, D) for d in host]

    def _idx(self, blocks: list[int]) -> torch.Tensor:
        t = torch.tensor(blocks, dtype=torch.long)
        return t if self.sim is not None else t.cuda()

    def snapshot(self, layer: int, blocks: list[int]) -> Callable[[], torch.Tensor]:
        """A compute-stream read (the forward's attention) of ``blocks``; call the result after
        ``synchronize`` for the canonical ``[2, n*N, H, D]`` bytes seen at that point."""
        out: list[torch.Tensor] = []
        idx = self._idx(blocks)

        def read() -> None:
            ref = torch.empty(2, len(blocks) * N, H, D, dtype=DT, device=idx.device)
            gather_layer(self.views[layer], idx, ref)
            out.append(ref)

        self.compute(read, backlog=0.0)
        return lambda: out[0].cpu()

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

    def synchronize(self) -> None:
        self.dev.synchronize()

    def close(self) -> None:
        if self.sim is not None:
            self.sim.close()
        else:
            torch.cuda.synchronize()


def blocks(eng: Engine, n: int) -> list[int]:
    return eng.rng.sample(range(B), n)


def items(payloads: list[torch.Tensor], ids: list[int]) -> list[RestoreItem]:
    per = C // N
    return [RestoreItem(p, 0, C, ids[i * per:(i + 1) * per]) for i, p in enumerate(payloads)]


def expected(payloads: list[torch.Tensor], layer: int) -> torch.Tensor:
    return torch.cat([p[layer] for p in payloads], dim=1)


def layerwise_restore(eng: Engine, its: list[RestoreItem], ids: list[int], *,
                      wait_layers: bool) -> list[Callable[[], torch.Tensor]]:
    """The worker's sync-load protocol: begin on the forward thread, restore on a loader thread,
    per-layer waits (or none) each followed by the forward's read of the layer, then finish."""
    copier = eng.copier
    pipe = LayerPipeline(name="copier-loader")
    plan: list[object] = []
    copier.begin_restore(L)
    eng.slow(copier.load_stream)
    run = pipe.start(L, lambda layer: copier.restore_layer(eng.views[layer], layer, plan[0]),  # type: ignore[arg-type]
                     lambda: plan.append(copier.prepare_restore(its)))
    reads = []
    for layer in range(L):
        if wait_layers:
            assert run.wait(layer, 30)
            copier.layer_ready(layer)
            reads.append(eng.snapshot(layer, ids))
    run.join()
    assert run.ok
    copier.finish_restore()
    pipe.close()
    return reads


# --- scenarios (each asserts; the test files choose device and seeds) --------------------------------
def restore_over_pending_writes(eng: Engine, pinned: bool) -> None:
    """R1 + R2: a preempted request's writes and the zeroing of the new blocks are still queued
    on the compute stream when the load starts; each layer's read must see the restore."""
    ids = blocks(eng, 6)
    payloads = eng.payloads(3, pinned)
    eng.fill_blocks(ids, None)   # a preempted request's writes to blocks now handed over
    eng.fill_blocks(ids, 0.0)    # the scheduler's zeroing of the new blocks
    reads = layerwise_restore(eng, items(payloads, ids), ids, wait_layers=True)
    after = [eng.snapshot(layer, ids) for layer in range(L)]
    eng.synchronize()
    for layer in range(L):
        want = expected(payloads, layer)
        assert torch.equal(reads[layer](), want), f"layer {layer} read before its restore landed"
        assert torch.equal(after[layer](), want), f"layer {layer} restore was clobbered"
        assert float(reads[layer]().float().sum()) == float(want.float().sum())


def restore_without_layer_waits(eng: Engine) -> None:
    """R2, second half: the next step's reads follow layers nobody waited for."""
    ids = blocks(eng, 4)
    payloads = eng.payloads(2, pinned=True)
    layerwise_restore(eng, items(payloads, ids), ids, wait_layers=False)
    reads = [eng.snapshot(layer, ids) for layer in range(L)]
    eng.synchronize()
    for layer in range(L):
        assert torch.equal(reads[layer](), expected(payloads, layer))


def async_restore_over_pending_writes(eng: Engine) -> None:
    """R3: the async load's order event is taken on the forward thread."""
    ids = blocks(eng, 4)
    payloads = eng.payloads(2, pinned=True)
    eng.fill_blocks(ids, None)
    eng.fill_blocks(ids, 0.0)
    after = eng.copier.order_async()
    errors: list[BaseException] = []

    def load() -> None:
        try:
            eng.copier.restore_blocking(eng.views, items(payloads, ids), after)
        except BaseException as exc:  # noqa: BLE001 - re-raised below on the test thread
            errors.append(exc)

    t = threading.Thread(target=load, name="copier-async-load")
    t.start()
    t.join(30)
    assert not errors, errors
    reads = [eng.snapshot(layer, ids) for layer in range(L)]  # vLLM hears "finished" now
    eng.synchronize()
    for layer in range(L):
        assert torch.equal(reads[layer](), expected(payloads, layer))


def capture_between_writes(eng: Engine, jobs: list[list[int]]) -> None:
    """C1-C3: the forward writes each layer then ``save_kv_layer`` captures it; after
    ``wait_for_save`` the next step overwrites the same blocks at once; the saver thread,
    after the fence, must hold exactly what was written before the capture."""
    copier = eng.copier
    per = C // N
    staging = [[eng.dev.pinned((L, 2, C, H, D), DT) for _ in range(len(ids) // per)] for ids in jobs]
    indices: list[CaptureIndex] = [copier.begin_capture(ids, per) for ids in jobs]
    truth: list[list[torch.Tensor]] = [[] for _ in jobs]
    for layer in range(L):
        for j, ids in enumerate(jobs):
            truth[j] += eng.fill_blocks(ids, None, range(layer, layer + 1))
        eng.slow(copier.gather_stream)
        copier.capture_layer(eng.views[layer], layer,
                             [(ix, [t[layer] for t in st]) for ix, st in zip(indices, staging)])
    fence = copier.end_capture()
    for ids in jobs:
        eng.fill_blocks(ids, -1.0, range(L), backlog=0.0)  # the next step reuses the blocks
    seen: list[list[torch.Tensor]] = []

    def saver() -> None:
        fence.wait()
        seen.extend([[t.clone() for t in st] for st in staging])

    t = threading.Thread(target=saver, name="copier-saver")
    t.start()
    t.join(30)
    eng.synchronize()
    for j, chunks in enumerate(seen):
        for c, chunk in enumerate(chunks):
            for layer in range(L):
                want = truth[j][layer][:, c * per * N:(c + 1) * per * N]
                assert torch.equal(chunk[layer], want), f"job {j} chunk {c} layer {layer} differs"
    assert len(seen) == len(jobs)


def capture_scratch_outlives_its_copies(eng: Engine) -> bool:
    """Capture layers 0 and 1 while the D2H stream is held, waiting (on the host) for each
    gather to run, so layer 0's gather scratch is let go of before layer 1 asks the allocator
    for the same size on the gather stream (``keep``/``record_stream`` must stop it handing the
    block out while the D2H copies still read it). True when the staging holds exactly what
    each layer held (the caller asserts; the control inverts it)."""
    copier, per = eng.copier, C // N
    ids = blocks(eng, 4)
    staging = [eng.dev.pinned((L, 2, C, H, D), DT) for _ in range(2)]
    cap = copier.begin_capture(ids, per)
    release = eng.hold(copier.d2h_stream)
    truth: list[torch.Tensor] = []
    try:
        for layer in range(2):
            truth += eng.fill_blocks(ids, None, range(layer, layer + 1))
            copier.capture_layer(eng.views[layer], layer, [(cap, [t[layer] for t in staging])])
            gathered = eng.dev.new_event()
            eng.dev.record(gathered, copier.gather_stream)
            gathered.synchronize()
    finally:
        release()
    copier.end_capture().wait()
    return all(torch.equal(t[layer], truth[layer][:, c * per * N:(c + 1) * per * N])
               for layer in range(2) for c, t in enumerate(staging))

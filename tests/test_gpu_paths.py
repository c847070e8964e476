"""The CUDA path of the vLLM connector's copier, on a real GPU (``make test-gpu``; skipped here).

The scenarios are the ones tests/test_copier_sim.py runs on the simulated device
(tests/copier_harness.py), now on torch.cuda streams with the compute stream kept busy by
``torch.cuda._sleep``: a missing wait makes a read, a restore or a capture wrong, byte for byte
(caches are filled with random data, never compared after a synchronize that would hide a race).
Plus what only a GPU can show: no host synchronisation on the forward thread, pinned memory.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from copier_harness import (
    Engine,
    async_restore_over_pending_writes,
    blocks,
    capture_between_writes,
    capture_scratch_outlives_its_copies,
    restore_over_pending_writes,
    restore_without_layer_waits,
)
from kvtier_vllm.copier import CaptureIndex
from kvtier_vllm.device import CudaDevice
from kvtier_vllm.staging import StagingPool

from kvtier.config import CpuTierConfig
from kvtier.pinned import HostRegion
from kvtier.tiers.cpu import CpuTier

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]
SEEDS = range(6)


@pytest.fixture
def eng_factory():  # type: ignore[no-untyped-def]
    made: list[Engine] = []

    def make(seed: int) -> Engine:
        made.append(Engine("cuda", seed))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("seed", SEEDS)
def test_layer_reads_see_the_restore_over_pending_zeroing(eng_factory, seed: int, pinned: bool) -> None:  # type: ignore[no-untyped-def]
    restore_over_pending_writes(eng_factory(seed), pinned)


@pytest.mark.parametrize("seed", SEEDS)
def test_finish_restore_orders_the_next_step(eng_factory, seed: int) -> None:  # type: ignore[no-untyped-def]
    restore_without_layer_waits(eng_factory(seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_async_restore_follows_compute_work_enqueued_before_it(eng_factory, seed: int) -> None:  # type: ignore[no-untyped-def]
    async_restore_over_pending_writes(eng_factory(seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_capture_sees_writes_before_it_and_not_after(eng_factory, seed: int) -> None:  # type: ignore[no-untyped-def]
    eng = eng_factory(seed)
    ids = blocks(eng, 8)
    capture_between_writes(eng, [ids[:4], ids[4:]])


def test_gather_scratch_is_not_reused_while_d2h_copies_read_it(eng_factory) -> None:  # type: ignore[no-untyped-def]
    """record_stream on the gather scratch: with the D2H stream held and each gather done,
    the next layer's scratch must not be the block the D2H copies still read."""
    assert capture_scratch_outlives_its_copies(eng_factory(0))


def test_forward_thread_calls_never_synchronise_the_host(eng_factory) -> None:  # type: ignore[no-untyped-def]
    """With the compute stream busy for ~0.5 s, every call the forward thread makes returns
    at once, and none is a hidden host sync (sync debug mode "error" raises on one)."""
    eng = eng_factory(0)
    ids = blocks(eng, 8)
    per = 2
    staging = [eng.dev.pinned(t.shape, t.dtype) for t in eng.payloads(4, pinned=True)]
    torch.cuda._sleep(1_000_000_000)
    worst = 0.0
    torch.cuda.set_sync_debug_mode("error")
    try:
        t0 = time.perf_counter()
        eng.copier.begin_restore(3)
        cap: CaptureIndex = eng.copier.begin_capture(ids, per)
        for layer in range(3):
            eng.copier.capture_layer(eng.views[layer], layer, [(cap, [t[layer] for t in staging])])
        fence = eng.copier.end_capture()
        after = eng.copier.order_async()
        worst = time.perf_counter() - t0
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert worst < 0.1, f"forward-thread calls took {worst * 1e3:.1f} ms behind a busy stream"
    assert not fence.event.query()  # type: ignore[attr-defined]
    fence.wait()
    after.synchronize()
    eng.copier.finish_restore()


def test_host_memory_is_pinned_without_the_power_of_two_allocator() -> None:
    region = HostRegion(3 * (1 << 20) + 4096, "always", align=1 << 20)
    assert region.pinned
    t = torch.frombuffer(region.map, dtype=torch.uint8, count=region.nbytes)
    assert t.is_pinned()
    tier = CpuTier(CpuTierConfig(capacity_bytes=8 << 20, slot_bytes=1 << 20, pin_memory="always"))
    assert tier.pinned
    tier.close()
    pool = StagingPool(4 << 20, (2, 2, 16, 8, 64), torch.float16, CudaDevice(torch.device("cuda")).host_buffer)
    assert pool.slots == (4 << 20) // (2 * 2 * 16 * 8 * 64 * 2)
    assert pool.tensor(0).is_pinned()


def test_restores_copy_from_pinned_slots_without_blocking() -> None:
    """A chunk read into a restore slot is a pinned view, so its H2D copy is asynchronous."""
    import numpy as np
    from kvtier_vllm.restorebufs import RestoreBuffers

    from kvtier.cache import PrefixCache
    from kvtier.keys import KVLayout, NamespaceSpec
    from kvtier.store import TieredStore
    from kvtier.tiers.memory import MemoryTier

    lay = KVLayout(num_layers=2, num_kv_heads=8, head_dim=64, chunk_tokens=16)
    cache = PrefixCache(TieredStore([MemoryTier(1 << 24)]), NamespaceSpec("gpu-restore", lay, kv_dtype="float16"))
    shape = lay.chunk_shape(16)
    tokens = np.arange(32, dtype=np.uint32)
    raw = torch.randn(2, 2, 32, 8, 64).to(torch.float16)
    assert cache.save(tokens, lambda a, b: raw[:, :, a:b].contiguous().numpy().tobytes(), full_chunks_only=True) == 2
    cache.store.flush(5)
    bufs = RestoreBuffers(4 << 20, shape, torch.float16, CudaDevice(torch.device("cuda")).host_buffer, lambda n: None)
    res = bufs.load(cache, tokens, 0, 2)
    assert res.complete
    for j in range(2):
        t = bufs.payload(res, j, shape, torch.float16)
        assert t.is_pinned()
        torch.cuda.set_sync_debug_mode("error")
        try:
            dev = t.to("cuda", non_blocking=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.equal(dev.cpu(), raw[:, :, 16 * j:16 * (j + 1)])
    bufs.release(res)


def test_a_staging_slot_past_the_first_gib_is_pinned_memory_to_a_copy() -> None:
    """A 2 GiB save pool (the default size) whose slots do not divide 1 GiB: the slot across
    the 1 GiB mark was registered in two pieces before (cudaHostRegister per GiB); a D2H copy
    into it must still be asynchronous: with the D2H stream busy ~0.5 s, it returns at once."""
    from kvtier.chunk import HEADER_SIZE

    dev = CudaDevice(torch.device("cuda"))
    shape = (32, 2, 256, 8, 128)  # 32 MiB chunks: slots of 32 MiB + 4 KiB
    pool = StagingPool(2 << 30, shape, torch.float16, dev.host_buffer, head=HEADER_SIZE)
    base = pool.raw(0).data_ptr()  # the region's first byte (page-aligned: no offset)
    across = next(s for s in range(pool.slots)
                  if (pool.raw(s).data_ptr() - base) < (1 << 30) < (pool.raw(s).data_ptr() - base + pool.slot_bytes))
    src = torch.randn(shape, device="cuda").to(torch.float16)
    stream = dev.new_stream()
    torch.cuda.synchronize()
    dev.launch(stream, lambda: torch.cuda._sleep(1_000_000_000))
    t0 = time.perf_counter()
    dev.copy(pool.tensor(across), src, stream)
    took = time.perf_counter() - t0
    stream.synchronize()
    assert took < 0.1, f"the copy into slot {across} blocked {took * 1e3:.0f} ms: not pinned memory"
    assert torch.equal(pool.tensor(across), src.cpu())


def test_a_failed_host_registration_leaves_no_cuda_error_for_the_next_kernel() -> None:
    """cudaHostRegister's error stays pending in the thread's runtime state; uncleared, the
    next kernel launch on the thread (the engine's forward) fails with it."""
    torch.ones(1, device="cuda").add_(1)
    torch.cuda.synchronize()
    region = HostRegion(4 << 20, "always")
    assert region.pinned
    region._register("always")  # registering the same pages again fails
    assert not region.pinned
    x = torch.ones(4, device="cuda").add_(1)  # raises "CUDA error: ... already mapped" if pending
    torch.cuda.synchronize()
    assert float(x.sum()) == 8.0
    region.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_a_rank_on_the_second_gpu_creates_no_context_on_the_first() -> None:
    """As a TP rank on cuda:1: vLLM sets cuda:1 on its own thread, kvtier's loader thread
    starts on cuda:0 (CUDA's current device is per thread). Its staging registration and
    its copies must run in cuda:1's context and leave none on cuda:0 (~0.5 GiB of another
    rank's GPU each): cudaHostRegister acts on the current device, and leaving
    ``torch.cuda.stream`` sets the thread's device back with cudaSetDevice."""
    import subprocess

    code = (
        "import threading, torch\n"
        "torch.cuda.set_device(1)\n"
        "from kvtier_vllm.device import CudaDevice\n"
        "from kvtier_vllm.devcopier import DeviceCopier\n"
        "dev = CudaDevice(torch.device('cuda:1'))\n"
        "c = DeviceCopier(dev)\n"
        "out = []\n"
        "def loader():\n"
        "    buf = dev.host_buffer(1 << 20)\n"
        "    x = dev.scratch((1 << 20,), torch.uint8, c.load_stream)\n"
        "    dev.launch(c.load_stream, lambda: x.fill_(1))\n"
        "    dev.copy(buf, x, c.load_stream)\n"
        "    e = dev.new_event()\n"
        "    dev.record(e, c.load_stream)\n"
        "    e.synchronize()\n"
        "    out.append(bool((buf == 1).all()))\n"
        "t = threading.Thread(target=loader)\n"
        "t.start()\n"
        "t.join()\n"
        "assert out == [True], out\n"
        "assert not torch._C._cuda_hasPrimaryContext(0), 'a context was created on cuda:0'\n"
    )
    root = Path(__file__).resolve().parents[1]
    env = {**__import__("os").environ, "PYTHONPATH": f"{root}:{root / 'connectors'}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

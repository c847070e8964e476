"""Restores from the bounded pinned pool (connectors/kvtier_vllm/restorebufs.py, staging.py):
chunks are read straight into pool slots, the H2D copies read views of those slots, and a slot
goes back to the pool only once the copies reading it have run (``finish_restore``'s fence;
ordering R4 in devcopier.py). On the simulated device a slot reused early gives wrong bytes.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.blocks import detect_layout, kv_views
from kvtier_vllm.copier import RestoreItem
from kvtier_vllm.devcopier import DeviceCopier
from kvtier_vllm.restorebufs import RestoreBuffers
from kvtier_vllm.simdevice import SimDevice
from kvtier_vllm.staging import StagingPool

from kvtier.cache import PrefixCache
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.prefetch import LoadedRange, Prefetcher
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier

B, N, W, LAYERS, PER = 64, 4, 16, 4, 2  # blocks, block size, latent width, layers, blocks a chunk


@pytest.mark.parametrize("seed", range(8))
def test_a_restore_slot_is_reused_only_after_its_h2d_copies_ran(seed: int) -> None:
    """One slot, many restores in a row: each writes its chunk into the slot on the host while
    the previous restore's copies may still be queued. Releasing the slot before the fence
    completed (``give`` instead of ``give_after``) restores a later chunk's bytes."""
    sim = SimDevice(seed=seed, max_delay_s=0.002)
    try:
        sim.set_current(sim.compute)
        layout = detect_layout(torch.zeros(B, N, W), backend="FLASHMLA", block_size=N,
                               num_kv_heads=1, head_dim=W, mla=True)
        dev = [sim.device_tensor(torch.zeros(B, N, W)) for _ in range(LAYERS)]
        views = [kv_views(x, layout) for x in dev]
        copier = DeviceCopier(sim)
        pool = StagingPool(1 << 20, (LAYERS, 1, PER * N, 1, W), torch.float32, sim.host_buffer,
                           slot_bytes=8192)
        pool.take(pool.slots - 1)  # leave exactly one slot in play
        rounds = B // PER
        for r in range(rounds):
            end = time.monotonic() + 10
            while not (slots := pool.take(1)):
                assert time.monotonic() < end, "the slot never came back"
                time.sleep(0.0005)
            chunk = pool.tensor(slots[0])
            chunk.fill_(float(r + 1))  # the store reading the next chunk into the slot
            copier.begin_restore(LAYERS)
            ids = list(range(r * PER, (r + 1) * PER))
            plan = copier.prepare_restore([RestoreItem(chunk, 0, PER * N, ids)])
            for layer in range(LAYERS):
                copier.restore_layer(views[layer], layer, plan)
            pool.give_after(slots, copier.finish_restore())
        sim.synchronize()
        assert sim.pageable_copies == 0
        for layer in range(LAYERS):
            for r in range(rounds):
                got = dev[layer][r * PER:(r + 1) * PER]
                assert torch.equal(got, torch.full_like(got, float(r + 1))), (layer, r)
    finally:
        sim.close()


def test_give_after_holds_slots_until_the_fence_completes() -> None:
    class Gate:
        def __init__(self) -> None:
            self.open = False

        def query(self) -> bool:
            return self.open

    pool = StagingPool(4 * 64, (4, 4), torch.float32, lambda n: torch.zeros(n, dtype=torch.uint8))
    assert pool.slots == 4
    got = pool.take(4)
    gate = Gate()
    pool.give_after(got[:3], gate)
    assert pool.free == 0 and pool.take(1) == []
    gate.open = True
    assert pool.free == 3 and len(pool.take(4)) == 3
    with pytest.raises(ValueError, match="slot_bytes"):
        StagingPool(1024, (4, 4), torch.float32, lambda n: torch.zeros(n, dtype=torch.uint8), slot_bytes=8)


LAY = KVLayout(num_layers=2, num_kv_heads=1, head_dim=4, chunk_tokens=8)
SPEC = NamespaceSpec("restore-staging-test", LAY, kv_dtype="float32")
TOKENS = np.arange(100, 140, dtype=np.uint32)  # 5 full chunks
SHAPE = LAY.chunk_shape(8)


def _payload(start: int, end: int) -> bytes:
    return np.arange(start * 16, end * 16, dtype=np.float32).reshape(2, 2, end - start, 1, 4).tobytes()


def _cache() -> PrefixCache:
    cache = PrefixCache(TieredStore([MemoryTier(1 << 24)]), SPEC)
    assert cache.save(TOKENS, _payload, full_chunks_only=True) == 5
    cache.store.flush(5)
    return cache


def test_restore_buffers_read_into_slots_and_fall_back_to_pageable_when_short() -> None:
    counted: list[int] = []
    bufs = RestoreBuffers(3 * 4096, SHAPE, torch.float32, lambda n: torch.zeros(n, dtype=torch.uint8),
                          counted.append)
    assert bufs.pool.slots == 3 and bufs.pool.slot_bytes == 4096
    cache = _cache()
    res = bufs.load(cache, TOKENS, 1, 4)
    assert res.complete and bufs.slots(res) and bufs.pool.free == 0
    for j in range(3):
        t = bufs.payload(res, j, SHAPE, torch.float32)
        want = torch.frombuffer(bytearray(_payload((1 + j) * 8, (2 + j) * 8)), dtype=torch.float32)
        assert torch.equal(t.flatten(), want)
        # a view of the slot the chunk was read into, not a copy
        slot = bufs.pool.raw(bufs.slots(res)[j])
        assert slot.data_ptr() <= t.data_ptr() < slot.data_ptr() + bufs.pool.slot_bytes
    assert counted == []
    short = bufs.load(cache, TOKENS, 0, 2)  # pool empty: pageable bytes, no slots
    assert short.complete and bufs.slots(short) == []
    assert torch.equal(bufs.payload(short, 1, SHAPE, torch.float32).flatten(),
                       torch.frombuffer(bytearray(_payload(8, 16)), dtype=torch.float32))
    assert counted == [1]
    bufs.release(res)
    assert bufs.pool.free == 3


def test_a_prefetch_dropped_untaken_gives_its_slots_back() -> None:
    bufs = RestoreBuffers(4 * 4096, SHAPE, torch.float32, lambda n: torch.zeros(n, dtype=torch.uint8),
                          lambda n: None)
    cache = _cache()
    gate = threading.Event()

    def slow() -> LoadedRange:
        res = bufs.load(cache, TOKENS, 0, 2)
        gate.wait(10)
        return res

    pf = Prefetcher(workers=2, max_bytes=1 << 20, on_drop=bufs.release)
    try:
        first = pf.submit("a", ("a",), lambda: bufs.load(cache, TOKENS, 0, 2))
        pending = pf.submit("b", ("b",), slow)
        assert first is not None and pending is not None
        first.result(10)                       # "a" finished (its future, not just its load)
        end = time.monotonic() + 10
        while bufs.pool.free > 0 and time.monotonic() < end:
            time.sleep(0.005)
        assert bufs.pool.free == 0 and first.done()
        pf.discard(["a"])                      # finished: released at once
        assert bufs.pool.free == 2
        pf.submit("b", ("b", 2), lambda: bufs.load(cache, TOKENS, 2, 3))  # replaces running "b"
        gate.set()
        pending.result(10)
        end = time.monotonic() + 10
        while bufs.pool.free < 3 and time.monotonic() < end:
            time.sleep(0.005)
        assert bufs.pool.free == 3             # "b" released once it finished; new "b" holds 1
        taken = pf.pop("b")
        assert taken is not None
        res = taken.result(10)
        assert res is not None and len(bufs.slots(res)) == 1  # popped: the taker's to release
        bufs.release(res)
        assert bufs.pool.free == 4
    finally:
        gate.set()
        pf.close()


def test_staging_pool_head_leaves_header_room_in_page_aligned_slots() -> None:
    # Save staging: each slot is [HEADER_SIZE free | chunk], starts on a page, and ``framed``
    # is the slot's header room + the bytes ``tensor`` views (the chunk the store takes).
    from kvtier.chunk import HEADER_SIZE, PAGE

    shape, dtype = (2, 2, 8, 2, 4), torch.float32
    pool = StagingPool(3 * (PAGE + 1024), shape, dtype, lambda n: torch.zeros(n, dtype=torch.uint8),
                       head=HEADER_SIZE)
    assert pool.slot_bytes == PAGE and pool.slots == 3  # 128 + 1,024 bytes, rounded to a page
    for slot in range(pool.slots):
        assert pool.raw(slot).data_ptr() % PAGE == 0
        t = pool.tensor(slot)
        assert t.shape == shape and t.data_ptr() == pool.raw(slot).data_ptr() + HEADER_SIZE
        t.fill_(slot + 1)
        framed = pool.framed(slot)
        assert framed.nbytes == HEADER_SIZE + pool.chunk_bytes
        assert np.array_equal(np.frombuffer(framed, np.float32)[HEADER_SIZE // 4:], t.flatten().numpy())
    with pytest.raises(ValueError):
        StagingPool(PAGE, shape, dtype, lambda n: torch.zeros(n, dtype=torch.uint8), head=6)
    plain = StagingPool(3 * 1024, shape, dtype, lambda n: torch.zeros(n, dtype=torch.uint8))
    assert plain.head == 0 and plain.slot_bytes == 1024 and plain.slots == 3

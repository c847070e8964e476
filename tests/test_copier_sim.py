"""The device copier's stream ordering, proved on the simulated asynchronous device (CI).

``DeviceCopier`` runs unchanged on ``SimDevice`` (each stream a thread with random delays; an
event completes only when its stream reaches it). The scenarios (tests/copier_harness.py) play
the engine's side on the simulated compute stream behind a random backlog: block zeroing, a
preempted block rewritten, the forward writing and reading a layer's KV, the next step
overwriting captured blocks; every assertion is byte-exact, over many seeds. Removing any one
of the copier's waits (R1-R3, C1-C3 in devcopier.py) makes one of these tests fail; the same
scenarios run on a real GPU in tests/test_gpu_paths.py.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from copier_harness import (
    DT,
    C,
    D,
    Engine,
    H,
    L,
    N,
    async_restore_over_pending_writes,
    blocks,
    capture_between_writes,
    capture_scratch_outlives_its_copies,
    restore_over_pending_writes,
    restore_without_layer_waits,
)
from kvtier_vllm.simdevice import SimDevice

SEEDS = range(24)


@pytest.fixture
def sim_engine():  # type: ignore[no-untyped-def]
    made: list[Engine] = []

    def make(seed: int) -> Engine:
        made.append(Engine("sim", seed))
        return made[-1]

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
@pytest.mark.parametrize("seed", SEEDS)
def test_layer_reads_see_the_restore_and_pending_zeroing_never_clobbers_it(sim_engine, seed: int, pinned: bool) -> None:  # type: ignore[no-untyped-def]
    eng = sim_engine(seed)
    restore_over_pending_writes(eng, pinned)
    assert eng.sim is not None
    # Pageable payloads take CUDA's synchronous path (and block the loader thread); pinned
    # ones never do.
    assert eng.sim.pageable_copies == (0 if pinned else 2 * 3 * 3)


@pytest.mark.parametrize("seed", SEEDS)
def test_finish_restore_orders_the_next_step_after_layers_nobody_waited_for(sim_engine, seed: int) -> None:  # type: ignore[no-untyped-def]
    restore_without_layer_waits(sim_engine(seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_async_restore_waits_for_compute_work_enqueued_before_it_started(sim_engine, seed: int) -> None:  # type: ignore[no-untyped-def]
    async_restore_over_pending_writes(sim_engine(seed))


@pytest.mark.parametrize("seed", SEEDS)
def test_capture_sees_the_layer_written_before_it_and_not_the_writes_after(sim_engine, seed: int) -> None:  # type: ignore[no-untyped-def]
    eng = sim_engine(seed)
    ids = blocks(eng, 8)
    capture_between_writes(eng, [ids[:4], ids[4:]])
    assert eng.sim is not None and eng.sim.pageable_copies == 0


def test_the_simulated_device_catches_a_missing_wait() -> None:
    """Control: a side stream that should have waited for the compute stream, without the
    wait, goes wrong for some seed; so the scenarios above can fail."""
    bad = 0
    for seed in SEEDS:
        dev = SimDevice(seed=seed)
        try:
            dev.set_current(dev.compute)
            side = dev.new_stream()
            t = dev.zeros((4,), torch.float32)
            pause = 0.003 * (seed % 3)
            dev.launch(dev.compute, lambda: time.sleep(pause))  # noqa: B023 - runs before the loop moves on
            dev.launch(dev.compute, lambda: t.fill_(1.0))  # noqa: B023
            dev.launch(side, lambda: t.add_(1.0))  # noqa: B023 - needed a wait_event on the fill
            dev.synchronize()
            bad += int(not torch.equal(t, torch.full((4,), 2.0)))
        finally:
            dev.close()
    assert bad > 0


def test_events_and_waits_order_exactly_what_they_name() -> None:
    dev = SimDevice(seed=3)
    try:
        a, b = dev.new_stream(), dev.new_stream()
        t = dev.zeros((1,), torch.float32)
        gate = threading.Event()
        e = dev.new_event()
        assert e.query()                            # never recorded: complete
        dev.wait_event(b, e)                        # orders nothing
        dev.launch(a, lambda: gate.wait(5))
        dev.launch(a, lambda: t.fill_(1.0))
        dev.record(e, a)
        assert not e.query()                        # a has not reached the marker
        dev.wait_event(b, e)
        dev.launch(b, lambda: t.mul_(3.0))
        gate.set()
        e.synchronize()
        dev.synchronize()
        assert float(t[0]) == 3.0
    finally:
        dev.close()


def test_stream_failures_reach_the_host() -> None:
    dev = SimDevice(seed=0)
    s = dev.new_stream()

    def boom() -> None:
        raise ValueError("kernel failed")

    dev.launch(s, boom)
    with pytest.raises(RuntimeError, match="kernel failed"):
        dev.synchronize()
    with pytest.raises(RuntimeError, match="kernel failed"):
        dev.close()


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


def test_a_capture_that_fails_half_way_still_fences_the_copies_it_queued(sim_engine) -> None:  # type: ignore[no-untyped-def]
    """A capture_layer call that raises after queueing a job's D2H copies (a later job's
    staging has the wrong shape) must still leave end_capture a fence over those copies: the
    saver gives the slots back once it completes, and a slot given back while a copy still
    writes it would hand another job's chunk those stale bytes."""
    eng = sim_engine(5)
    copier = eng.copier
    ids = blocks(eng, 4)
    per = C // N
    good = [eng.dev.pinned((L, 2, C, H, D), DT) for _ in range(2)]
    bad = [eng.dev.pinned((L, 2, C // 2, H, D), DT)]
    truth = eng.fill_blocks(ids, None, range(0, 1))[0]
    jobs = [copier.begin_capture(ids, per), copier.begin_capture(ids[:per], per)]
    gate = threading.Event()
    eng.dev.launch(copier.d2h_stream, lambda: gate.wait(10))  # the D2H stream is still busy
    with pytest.raises(RuntimeError):
        copier.capture_layer(eng.views[0], 0, [(jobs[0], [t[0] for t in good]), (jobs[1], [t[0] for t in bad])])
    fence = copier.end_capture()
    try:
        assert not fence.query(), "end_capture fenced nothing though copies were queued"
    finally:
        gate.set()
    fence.wait()
    for c, t in enumerate(good):
        assert torch.equal(t[0], truth[:, c * per * N:(c + 1) * per * N])


def test_gather_scratch_is_not_handed_out_again_while_d2h_copies_read_it(sim_engine) -> None:  # type: ignore[no-untyped-def]
    """``keep(tmp, d2h)`` (``record_stream`` on CUDA): the caching allocator must not give the
    gather scratch to the next gather while the D2H copies still read it. Control: with
    ``keep`` a no-op the simulated allocator reuses it and layer 0's chunk holds layer 1."""
    assert capture_scratch_outlives_its_copies(sim_engine(2))
    eng = sim_engine(3)
    assert eng.sim is not None
    eng.sim.keep = lambda t, s: None  # type: ignore[method-assign]
    assert not capture_scratch_outlives_its_copies(eng)

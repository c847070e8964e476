"""``DeviceCopier``: restore and capture on side streams of a ``Device``, ordered by events only.

Streams
    load    layer-wise restores of this step's sync loads (the loader thread feeds it).
    async   restores of ``load_async`` requests (the async-load thread feeds it).
    gather  captures: index_select of the saved blocks into device scratch.
    d2h     captures: scratch -> pinned staging copies (the saver thread waits on its fence).
Orderings (each one is a test in tests/test_copier_sim.py; removing it fails that test)
    R1 ``begin_restore``: the load stream waits for everything already on the compute stream
       (block zeroing, writes to blocks freed by preemption and handed to this load).
    R2 ``layer_ready``: the compute stream waits for layer i's restore event before the layer
       reads its blocks; ``finish_restore``: and for the whole load stream before the next step.
    R3 ``order_async`` + ``restore_blocking``: an async load waits for an event recorded on the
       compute stream when the load was started (same reason as R1; ``current_stream`` is only
       the compute stream on the forward thread, so the event is taken there).
    R4 ``finish_restore`` returns a fence on the load stream's copies, and ``restore_blocking``
       returns only after its copies ran: a restore's pinned host buffers go back to their
       pool only then (``StagingPool.give_after``), never while a copy may still read them.
    C1 ``capture_layer``: the gather waits for the compute stream's writes of that layer.
    C2 ``end_capture``: later compute-stream writes wait for the *gathers* only; the D2H tail
       runs on under the next step, and the saver thread waits for it (a blocking event).
    C4 ``end_capture`` fences every copy ``capture_layer`` queued, also when that call raised
       half-way (the failed step's slots go back to their pool only after that fence).
No host synchronisation on the forward thread: block ids reach the device as one pinned int64
index per job and step, copied asynchronously; every copy involves pinned host memory or
device memory only, except restores from a pageable payload (then the *loader* thread blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .blocks import Views
from .copier import DONE, CaptureIndex, Copier, CpuCopier, Fence, RestoreItem, RestorePlan
from .device import CudaDevice, Device, Event


class _EventFence:
    def __init__(self, event: Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()  # a blocking event: the saver thread sleeps, it does not spin

    def query(self) -> bool:
        return self.event.query()


class DeviceCopier:
    """See the module docstring for streams, orderings and threads."""

    def __init__(self, dev: Device) -> None:
        self.dev = dev
        self.load_stream = dev.new_stream()
        self.async_stream = dev.new_stream()
        self.gather_stream = dev.new_stream()
        self.d2h_stream = dev.new_stream()
        self._layer_events: list[Event] = []
        self._captured = False

    # --- indices ---------------------------------------------------------------------------------
    def _index(self, block_ids: Sequence[int], stream: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(device index, its pinned source): one asynchronous H2D copy on ``stream``."""
        host = self.dev.pinned((len(block_ids),), torch.int64)
        host.numpy()[:] = block_ids
        index = self.dev.scratch((len(block_ids),), torch.int64, stream)
        self.dev.copy(index, host, stream)
        return index, host

    # --- restore ---------------------------------------------------------------------------------
    def begin_restore(self, layers: int) -> None:
        dev = self.dev
        start = dev.new_event()
        dev.record(start, dev.current_stream())
        dev.wait_event(self.load_stream, start)  # R1
        self._layer_events = [dev.new_event() for _ in range(layers)]

    def prepare_restore(self, items: Sequence[RestoreItem]) -> RestorePlan:
        return self._plan(items, self.load_stream)

    def _plan(self, items: Sequence[RestoreItem], stream: Any) -> RestorePlan:
        ids = [b for it in items for b in it.block_ids]
        if not ids:
            return RestorePlan(items, ids)
        index, host = self._index(ids, stream)
        return RestorePlan(items, ids, index, host)

    def _restore(self, views: Views, layer: int, plan: RestorePlan, stream: Any) -> None:
        if plan.index is None:
            return
        n, h, d = views[0].shape[1:]
        planes, nb = len(views), len(plan.block_ids)
        tmp = self.dev.scratch((planes, nb, n, h, d), views[0].dtype, stream)
        b0 = 0
        for it in plan.items:
            k = len(it.block_ids)
            src = it.payload[layer, :, it.offset:it.offset + it.tokens]
            if k * n != it.tokens or src.shape[0] != planes:
                raise ValueError(f"restore item of {it.tokens} tokens, {src.shape[0]} planes does "
                                 f"not fill {k} blocks of {n} x {planes} planes")
            for p in range(planes):
                self.dev.copy(tmp[p, b0:b0 + k], src[p].view(k, n, h, d), stream)
            b0 += k
        index = plan.index

        def scatter() -> None:
            for p, dst in enumerate(views):
                dst.index_copy_(0, index, tmp[p])

        self.dev.launch(stream, scatter)

    def restore_layer(self, views: Views, layer: int, plan: RestorePlan) -> None:
        self._restore(views, layer, plan, self.load_stream)
        self.dev.record(self._layer_events[layer], self.load_stream)

    def layer_ready(self, layer: int) -> None:
        self.dev.wait_event(self.dev.current_stream(), self._layer_events[layer])  # R2

    def finish_restore(self) -> Fence:
        # Layers the forward never waited for (a short run) still land before the next step.
        done = self.dev.new_event()
        self.dev.record(done, self.load_stream)
        self.dev.wait_event(self.dev.current_stream(), done)
        return _EventFence(done)  # R4: the run's host buffers are free once this completes

    def order_async(self) -> Event:
        ready = self.dev.new_event()
        self.dev.record(ready, self.dev.current_stream())
        return ready

    def restore_blocking(self, views: Sequence[Views], items: Sequence[RestoreItem], after: Any) -> None:
        if after is not None:
            self.dev.wait_event(self.async_stream, after)  # R3
        try:
            plan = self._plan(items, self.async_stream)
            for layer, v in enumerate(views):
                self._restore(v, layer, plan, self.async_stream)
        finally:
            # Also on failure: the caller reuses the payloads' buffers once this returns (R4).
            done = self.dev.new_event()
            self.dev.record(done, self.async_stream)
            done.synchronize()

    # --- capture ---------------------------------------------------------------------------------
    def begin_capture(self, block_ids: Sequence[int], per_chunk: int) -> CaptureIndex:
        index, host = self._index(block_ids, self.gather_stream)
        return CaptureIndex(list(block_ids), per_chunk, index, host)

    def capture_layer(self, views: Views, layer: int,
                      jobs: Sequence[tuple[CaptureIndex, Sequence[torch.Tensor]]]) -> None:
        dev = self.dev
        ready = dev.new_event()
        dev.record(ready, dev.current_stream())
        dev.wait_event(self.gather_stream, ready)  # C1
        n, h, d = views[0].shape[1:]
        planes = len(views)
        gathered: list[tuple[CaptureIndex, Sequence[torch.Tensor], torch.Tensor]] = []
        for cap, outs in jobs:
            tmp = dev.scratch((planes, len(cap.block_ids), n, h, d), views[0].dtype, self.gather_stream)
            gathered.append((cap, outs, tmp))
        work = [(cap.index, tmp) for cap, _, tmp in gathered]

        def gather() -> None:
            for index, tmp in work:
                for p, src in enumerate(views):
                    torch.index_select(src, 0, index, out=tmp[p])

        # From the first enqueued work on: end_capture must fence this step's copies even if
        # this call raises half-way (copies already queued still write the jobs' slots).
        self._captured = True
        dev.launch(self.gather_stream, gather)
        done = dev.new_event()
        dev.record(done, self.gather_stream)
        dev.wait_event(self.d2h_stream, done)
        for cap, outs, tmp in gathered:
            dev.keep(tmp, self.d2h_stream)
            per = cap.per_chunk
            for j, out in enumerate(outs):
                for p in range(planes):
                    dev.copy(out[p], tmp[p, j * per:(j + 1) * per].view(out[p].shape), self.d2h_stream)

    def end_capture(self) -> Fence:
        if not self._captured:
            return DONE
        self._captured = False
        dev = self.dev
        gathered = dev.new_event()
        dev.record(gathered, self.gather_stream)
        dev.wait_event(dev.current_stream(), gathered)  # C2
        copied = dev.new_event()
        dev.record(copied, self.d2h_stream)
        return _EventFence(copied)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self.dev.host_buffer(nbytes)


def make_copier(device: torch.device, thread_init: Callable[[], None] | None = None) -> Copier:
    """The copier for the engine's KV device: CUDA side streams, else block copies (captures
    on a thread started with ``thread_init``, when given)."""
    if device.type == "cuda":
        return DeviceCopier(CudaDevice(device))
    return CpuCopier(thread_init)

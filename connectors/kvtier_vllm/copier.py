"""Device-specific halves of restore (host payload -> paged blocks) and capture (blocks -> host).

``CpuCopier``  single-threaded block copies on the calling thread (never an OpenMP team next to
               the engine's): the loader thread restores while the forward thread runs earlier
               layers; captures are memcpys on the forward thread (a chunk of one layer is
               ~100 KiB-1 MiB: microseconds next to the layer's compute).
``CudaCopier`` a side CUDA stream: restores are H2D copies + scatter kernels enqueued on it with
               one event per layer, so ``layer_ready`` makes the compute stream wait on the GPU
               without blocking the host; captures are gather + D2H copies into pinned host
               buffers on the side stream, fenced by an event the saver thread waits on.

Threads: ``restore_layer`` runs on the loader thread, ``capture_layer``/``end_capture``/
``layer_ready`` on the forward thread, ``Fence.wait`` on the saver thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .blocks import gather_layer, gather_layer_host, scatter_layer, scatter_layer_host

Views = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class RestoreItem:
    """Tokens ``[offset, offset + tokens)`` of a chunk payload ``(L, 2, C, H, D)`` go to
    ``block_ids`` (``tokens / block_size`` of them)."""

    payload: torch.Tensor
    offset: int
    tokens: int
    block_ids: Sequence[int]


class Fence(Protocol):
    def wait(self) -> None: ...


class _Done:
    def wait(self) -> None:
        return None


class Copier(Protocol):
    def begin_restore(self, layers: int) -> None: ...

    def restore_blocking(self, views: Sequence[Views], items: Sequence[RestoreItem]) -> None: ...

    def restore_layer(self, views: Views, layer: int, items: Sequence[RestoreItem]) -> None: ...

    def layer_ready(self, layer: int) -> None: ...

    def finish_restore(self) -> None: ...

    def staging(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor: ...

    def capture_layer(self, views: Views, block_ids: Sequence[int], out: torch.Tensor) -> None: ...

    def end_capture(self) -> Fence: ...


class CpuCopier:
    def begin_restore(self, layers: int) -> None:
        return None

    def restore_blocking(self, views: Sequence[Views], items: Sequence[RestoreItem]) -> None:
        for layer, v in enumerate(views):
            self.restore_layer(v, layer, items)

    def restore_layer(self, views: Views, layer: int, items: Sequence[RestoreItem]) -> None:
        for it in items:
            scatter_layer_host(views, it.block_ids, it.payload[layer, :, it.offset:it.offset + it.tokens])

    def layer_ready(self, layer: int) -> None:
        return None

    def finish_restore(self) -> None:
        return None

    def staging(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def capture_layer(self, views: Views, block_ids: Sequence[int], out: torch.Tensor) -> None:
        gather_layer_host(views, block_ids, out)

    def end_capture(self) -> Fence:
        return _Done()


class _EventFence:
    def __init__(self, event: torch.cuda.Event) -> None:
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class CudaCopier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.load_stream = torch.cuda.Stream(device=device)
        self.async_stream = torch.cuda.Stream(device=device)
        self.save_stream = torch.cuda.Stream(device=device)
        self._events: list[torch.cuda.Event] = []
        self._captured = False

    # restore: forward thread begins, loader thread enqueues, forward thread waits on the GPU only
    def begin_restore(self, layers: int) -> None:
        # Order the loads after everything already enqueued on the compute stream (block
        # zeroing, the previous step's writes to blocks that were freed and reallocated).
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream(self.device))
        self.load_stream.wait_event(start)
        self._events = [torch.cuda.Event() for _ in range(layers)]

    def restore_blocking(self, views: Sequence[Views], items: Sequence[RestoreItem]) -> None:
        # Async loads fill blocks the compute stream does not touch until vLLM hears that
        # the load finished, so they need no ordering with it, only completion.
        with torch.cuda.stream(self.async_stream):
            for layer, v in enumerate(views):
                for it in items:
                    src = it.payload[layer, :, it.offset:it.offset + it.tokens]
                    scatter_layer(v, it.block_ids, src.to(self.device, non_blocking=True))
        self.async_stream.synchronize()

    def restore_layer(self, views: Views, layer: int, items: Sequence[RestoreItem]) -> None:
        with torch.cuda.stream(self.load_stream):
            for it in items:
                src = it.payload[layer, :, it.offset:it.offset + it.tokens]
                dev = src.to(self.device, non_blocking=True)
                scatter_layer(views, it.block_ids, dev)
            self._events[layer].record(self.load_stream)

    def layer_ready(self, layer: int) -> None:
        # Called after the host-side LayerRun says layer `layer` was enqueued.
        torch.cuda.current_stream(self.device).wait_event(self._events[layer])

    def finish_restore(self) -> None:
        # Layers the forward never waited for still must land before the next step.
        torch.cuda.current_stream(self.device).wait_stream(self.load_stream)

    # capture: forward thread enqueues on the side stream, saver thread waits on the fence
    def staging(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def capture_layer(self, views: Views, block_ids: Sequence[int], out: torch.Tensor) -> None:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        self.save_stream.wait_event(ready)
        with torch.cuda.stream(self.save_stream):
            tmp = torch.empty(out.shape, dtype=out.dtype, device=self.device)
            gather_layer(views, block_ids, tmp)
            out.copy_(tmp, non_blocking=True)
        self._captured = True

    def end_capture(self) -> Fence:
        done = torch.cuda.Event()
        done.record(self.save_stream)
        if self._captured:
            # The compute stream must not overwrite captured blocks before the copies ran.
            torch.cuda.current_stream(self.device).wait_event(done)
            self._captured = False
        return _EventFence(done)


def make_copier(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else CpuCopier()

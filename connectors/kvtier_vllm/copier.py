"""Device-specific halves of restore (host payload -> paged blocks) and capture (blocks -> host).

``CpuCopier``    single-threaded block copies (never an OpenMP team next to the engine's): the
                 loader thread restores while the forward thread runs earlier layers; captures
                 run on a ``kvtier-capture`` thread (off the engine's cores) while the forward
                 thread computes the later layers, and ``end_capture`` waits for the last
                 ones (without a ``thread_init`` they are copies on the calling thread).
``DeviceCopier`` (devcopier.py) side streams on a ``Device`` (CUDA, or the simulated device the
                 tests use), ordered against the engine's compute stream by events only.

Call protocol (threads)
    forward thread: ``begin_restore`` (before the loader starts), ``layer_ready``,
        ``finish_restore``, ``order_async``, ``begin_capture``, ``capture_layer``, ``end_capture``.
    loader thread: ``prepare_restore`` once per run, then ``restore_layer`` per layer.
    async-load thread: ``restore_blocking`` (with the event ``order_async`` gave on the forward
        thread when the load was started; its payloads are free again once it returns). saver thread: ``Fence.wait``.
Failure: methods raise RuntimeError/ValueError (the worker turns them into failed loads or
dropped saves); they never leave a stream waiting on an event that is not recorded.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .blocks import Views, gather_layer_host, scatter_layer_host

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestoreItem:
    """Tokens ``[offset, offset + tokens)`` of a chunk payload ``(L, P, C, H, D)`` go to
    ``block_ids`` (``tokens / block_size`` of them)."""

    payload: torch.Tensor
    offset: int
    tokens: int
    block_ids: Sequence[int]


@dataclass(frozen=True)
class RestorePlan:
    """One run's items with all their block ids in one index (device memory on a device)."""

    items: Sequence[RestoreItem]
    block_ids: Sequence[int]
    index: Any = None       # device int64 index of ``block_ids`` (DeviceCopier)
    host_index: Any = None  # its pinned source, kept alive with the plan


@dataclass(frozen=True)
class CaptureIndex:
    """One save job's block ids for one step, in chunk order (``per_chunk`` blocks a chunk)."""

    block_ids: Sequence[int]
    per_chunk: int
    index: Any = None
    host_index: Any = None


class Fence(Protocol):
    def wait(self) -> None: ...

    def query(self) -> bool:
        """True once the fenced work completed (never blocks)."""


class _Done:
    def wait(self) -> None:
        return None

    def query(self) -> bool:
        return True


DONE: Fence = _Done()


class Copier(Protocol):
    def begin_restore(self, layers: int) -> None: ...

    def prepare_restore(self, items: Sequence[RestoreItem]) -> RestorePlan: ...

    def restore_layer(self, views: Views, layer: int, plan: RestorePlan) -> None: ...

    def layer_ready(self, layer: int) -> None: ...

    def finish_restore(self) -> Fence:
        """Order the next step after this run; the fence completes when the run's host-to-device
        copies are done (then the restore's host buffers may be reused)."""

    def order_async(self) -> Any: ...

    def restore_blocking(self, views: Sequence[Views], items: Sequence[RestoreItem], after: Any) -> None: ...

    def begin_capture(self, block_ids: Sequence[int], per_chunk: int) -> CaptureIndex: ...

    def capture_layer(self, views: Views, layer: int,
                      jobs: Sequence[tuple[CaptureIndex, Sequence[torch.Tensor]]]) -> None: ...

    def end_capture(self) -> Fence: ...

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory (uint8) for capture staging: pinned on a device."""


def chunk_ids(index: CaptureIndex, j: int) -> Sequence[int]:
    return index.block_ids[j * index.per_chunk:(j + 1) * index.per_chunk]


class CpuCopier:
    """See the module docstring; every call but ``capture_layer`` completes before it returns.

    ``thread_init`` (e.g. ``threads.background_pinner()``): run captures on a thread started
    with it. Why this is safe: a step's saved blocks hold KV the step already computed, and the
    forward pass writes layer ``i``'s cache only in layer ``i``, so layer ``i``'s capture may
    run while later layers compute; ``end_capture`` (``wait_for_save``) returns only once
    every capture of the step ran, before anything can write those blocks again."""

    def __init__(self, thread_init: Callable[[], None] | None = None) -> None:
        self._captures: queue.Queue[Callable[[], None]] | None = None
        self._pending = 0
        self._done = threading.Semaphore(0)
        self._error: BaseException | None = None
        if thread_init is not None:
            self._captures = queue.Queue()
            threading.Thread(target=self._capture_loop, args=(thread_init,), name="kvtier-capture",
                             daemon=True).start()

    def _capture_loop(self, thread_init: Callable[[], None]) -> None:
        thread_init()
        assert self._captures is not None
        while True:
            work = self._captures.get()
            try:
                work()
            except Exception as exc:  # a bad shape or block id, or a bug: raised on the
                self._error = exc        # forward thread (below); this thread must live on
            finally:
                self._done.release()

    def begin_restore(self, layers: int) -> None:
        return None

    def prepare_restore(self, items: Sequence[RestoreItem]) -> RestorePlan:
        return RestorePlan(items, [b for it in items for b in it.block_ids])

    def restore_layer(self, views: Views, layer: int, plan: RestorePlan) -> None:
        for it in plan.items:
            scatter_layer_host(views, it.block_ids, it.payload[layer, :, it.offset:it.offset + it.tokens])

    def layer_ready(self, layer: int) -> None:
        return None

    def finish_restore(self) -> Fence:
        return DONE

    def order_async(self) -> None:
        return None

    def restore_blocking(self, views: Sequence[Views], items: Sequence[RestoreItem], after: Any = None) -> None:
        plan = self.prepare_restore(items)
        for layer, v in enumerate(views):
            self.restore_layer(v, layer, plan)

    def begin_capture(self, block_ids: Sequence[int], per_chunk: int) -> CaptureIndex:
        return CaptureIndex(list(block_ids), per_chunk)

    def capture_layer(self, views: Views, layer: int,
                      jobs: Sequence[tuple[CaptureIndex, Sequence[torch.Tensor]]]) -> None:
        def copy() -> None:
            for index, outs in jobs:
                for j, out in enumerate(outs):
                    gather_layer_host(views, chunk_ids(index, j), out)

        if self._captures is None:
            copy()
            return
        self._pending += 1
        self._captures.put(copy)

    def end_capture(self) -> Fence:
        """Wait for this step's captures (their copies have all ended when this returns, also
        when it raises the first capture error of the step)."""
        while self._pending:
            self._done.acquire()
            self._pending -= 1
        error, self._error = self._error, None
        if error is not None:
            raise ValueError(f"capture failed: {error}") from error
        return DONE

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

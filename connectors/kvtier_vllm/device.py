"""The few device operations the copier needs, behind one interface with two implementations.

``Device``     the contract: side streams, events (record / wait / host wait), work enqueued on
               a stream, asynchronous copies, device scratch memory, pinned host memory.
``CudaDevice`` torch.cuda (this module).
``SimDevice``  a simulated asynchronous device for tests (``simdevice.py``): each stream is a
               thread that runs its queue in order after random delays, so a missing
               ``wait_event`` shows up on a CPU-only machine as wrong bytes.

Contract (what both implementations guarantee, and all the copier may rely on)
- Work enqueued on one stream runs in enqueue order; work on different streams is unordered
  unless a ``wait_event`` orders it: ``wait_event(s, e)`` makes work enqueued on ``s`` *after the
  call* wait for the most recent ``record`` of ``e`` *before the call*. A never-recorded event
  is complete.
- ``copy(dst, src, stream)`` is asynchronous when the host side is pinned (or both sides are on
  the device); with pageable host memory it returns only once the copy is done (as CUDA's
  ``cudaMemcpyAsync`` does for pageable memory), which is why the hot paths use pinned buffers.
- ``current_stream()`` is the calling thread's current stream (torch keeps it per thread): only
  the engine's forward thread may use it to mean "the compute stream".
- ``scratch(shape, dtype, stream)`` is device memory meant for work on ``stream`` only; a tensor
  read on another stream must be ``keep(t, stream)``-ed so the allocator does not hand it out
  again before that stream is done with it.
Threads: any thread may call any method; one stream may be fed by one thread at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any, Protocol

import torch

from kvtier.pinned import HostRegion


class Event(Protocol):
    def synchronize(self) -> None:
        """Block the calling thread (without spinning) until the last record completed."""

    def query(self) -> bool: ...


class Device(Protocol):
    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any: ...

    def new_event(self) -> Event: ...

    def record(self, event: Event, stream: Any) -> None: ...

    def wait_event(self, stream: Any, event: Event) -> None: ...

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Enqueue ``fn`` (device work: kernels over device tensors) on ``stream``."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None: ...

    def scratch(self, shape: Sequence[int], dtype: torch.dtype, stream: Any) -> torch.Tensor: ...

    def keep(self, t: torch.Tensor, stream: Any) -> None: ...

    def pinned(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A small pinned host tensor (indices)."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A large pinned uint8 host buffer of exactly ``nbytes``, kept for the device's life."""

    def is_pinned(self, t: torch.Tensor) -> bool: ...

    def synchronize(self) -> None: ...


class CudaDevice:
    """``Device`` over torch.cuda for one CUDA device.

    Every method works with ``device`` current and gives the calling thread its own current
    device back, whatever that was: CUDA's current device is per thread, and kvtier's threads
    (loader, async loads) start on cuda:0 whatever device vLLM set on its own thread.
    ``torch.cuda.stream(s)`` alone, on a thread whose current device is not ``s``'s, sets
    the device back with ``cudaSetDevice`` on exit, which (CUDA 12) creates a context on it:
    every TP rank's process would put one on cuda:0. ``torch.cuda.device`` gives the device
    back without creating one."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._regions: list[HostRegion] = []

    def _on(self, stream: Any) -> ExitStack:
        """Make ``device`` current, then ``stream`` its current stream (undone on exit)."""
        ctx = ExitStack()
        ctx.enter_context(torch.cuda.device(self.device))
        ctx.enter_context(torch.cuda.stream(stream))
        return ctx

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_event(self) -> torch.cuda.Event:
        # blocking=True: a host wait sleeps in the driver instead of spinning a core.
        return torch.cuda.Event(blocking=True)

    def record(self, event: Event, stream: Any) -> None:
        assert isinstance(event, torch.cuda.Event)
        event.record(stream)

    def wait_event(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        with self._on(stream):
            fn()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
        with self._on(stream):
            dst.copy_(src, non_blocking=True)

    def scratch(self, shape: Sequence[int], dtype: torch.dtype, stream: Any) -> torch.Tensor:
        # Allocated while ``stream`` is current: the caching allocator ties the block to it.
        with self._on(stream):
            return torch.empty(tuple(shape), dtype=dtype, device=self.device)

    def keep(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def pinned(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=True)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        # Not torch's pinned allocator: it rounds up to a power of two.
        # One registration for the whole buffer (align=nbytes): the caller cuts it into slots
        # of a size this method never sees, and a slot across two registrations is not pinned
        # memory to a copy. Staging buffers are a few GiB, far below the driver's limits.
        # Registered with this device current: cudaHostRegister acts in the current device's
        # context (and would create one on cuda:0 for a process whose KV lives elsewhere).
        with torch.cuda.device(self.device) if torch.cuda.is_available() else nullcontext():
            region = HostRegion(nbytes, "always", align=max(nbytes, 1))
        self._regions.append(region)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(region.map, dtype=torch.uint8, count=nbytes)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.device.type == "cpu" and t.is_pinned()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

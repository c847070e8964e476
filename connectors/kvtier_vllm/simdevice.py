"""A simulated asynchronous device: the ``Device`` contract on CPU tensors, with real races.

Made for tests (and the CPU part of scripts/gpu_acceptance.py): the copier's ordering is only
right if it names every dependency with ``wait_event``; on this device a missing wait gives
wrong bytes on a CPU-only machine, as it would on a GPU.

Model
- Each stream is a thread running its queue in order; before each operation it sleeps a random
  delay (seeded per stream), so independent streams interleave differently from seed to seed.
- ``record`` enqueues a marker; the event completes only when its stream reaches the marker.
  ``wait_event(s, e)`` enqueues on ``s`` a wait for the record current at the call, and orders
  nothing else. A never-recorded event is complete.
- "Device memory" is ordinary CPU tensors registered with the device (``zeros``,
  ``device_tensor``, ``scratch``); "pinned" host memory is what ``pinned`` returned. Every other
  CPU tensor is pageable: ``copy`` to or from it blocks the calling thread until the stream has
  run the copy (CUDA's rule for pageable memory), and is counted in ``pageable_copies``.
- ``current_stream`` is per thread: a thread that called ``set_current(s)`` gets ``s``; any other
  thread gets its own idle stream, so recording on it orders nothing (as recording on the
  wrong thread's stream orders nothing on a GPU).
- ``scratch`` is a caching allocator as torch's is: memory the host has let go of (the last
  tensor or view of it dropped; queued copies do not hold it, as queued kernels do not on a
  GPU) is handed to the next ``scratch`` of the same size on the *stream it was allocated for*
  at once, whatever other streams still do with it; after ``keep(t, s)`` only once ``s`` has
  reached the point where it was let go (an event recorded then, as ``record_stream`` does).
  So a missing ``keep`` gives wrong bytes here too.
Failure: an exception inside a stream operation is kept and re-raised by ``synchronize``,
``Event.synchronize`` and ``close``; a wait that outlives ``timeout_s`` raises TimeoutError.
"""

from __future__ import annotations

import queue
import random
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch


class SimStream:
    def __init__(self, dev: SimDevice, name: str, seed: int) -> None:
        self.dev, self.name = dev, name
        self._rng = random.Random(seed)
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"sim-{name}", daemon=True)
        self._thread.start()

    def enqueue(self, op: Callable[[], None]) -> None:
        self._queue.put(op)

    def _loop(self) -> None:
        while True:
            op = self._queue.get()
            if op is None:
                return
            delay = self._rng.random() * self.dev.max_delay_s
            if self._rng.random() < 0.5:
                time.sleep(delay)
            try:
                op()
            except BaseException as exc:  # noqa: BLE001 - kept and re-raised on the host side
                self.dev._fail(exc, self.name)
            op = None  # a kernel that ran holds nothing: its tensors may be freed now

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=self.dev.timeout_s)

    def __repr__(self) -> str:
        return f"SimStream({self.name})"


class SimEvent:
    def __init__(self, dev: SimDevice) -> None:
        self.dev = dev
        self._flag: threading.Event | None = None  # the latest record's completion

    def synchronize(self) -> None:
        flag = self._flag
        if flag is not None and not flag.wait(self.dev.timeout_s):
            raise TimeoutError("simulated event did not complete")
        self.dev._raise()

    def query(self) -> bool:
        flag = self._flag
        return flag is None or flag.is_set()


class SimDevice:
    """See the module docstring. ``close()`` stops the stream threads."""

    def __init__(self, seed: int = 0, max_delay_s: float = 0.002, timeout_s: float = 30.0) -> None:
        self.seed, self.max_delay_s, self.timeout_s = seed, max_delay_s, timeout_s
        self._streams: list[SimStream] = []
        self._local = threading.local()
        self._lock = threading.Lock()
        self._memory: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._error: BaseException | None = None
        self.pageable_copies = 0
        # The allocator: live scratch by storage address -> (its memory, streams kept on);
        # what the host let go of (queued by a finalizer, which may run inside any lock);
        # reusable memory per allocating stream, each with the events it must wait for.
        self._scratch: dict[int, tuple[np.ndarray, set[SimStream]]] = {}
        self._freed: queue.SimpleQueue[tuple[SimStream, int]] = queue.SimpleQueue()
        self._pool: dict[SimStream, list[tuple[np.ndarray, list[SimEvent]]]] = {}
        self.compute = self.new_stream("compute")

    # --- streams and events -------------------------------------------------------------------
    def new_stream(self, name: str = "") -> SimStream:
        with self._lock:
            n = len(self._streams)
            s = SimStream(self, name or f"side{n}", self.seed * 7919 + n)
            self._streams.append(s)
        return s

    def set_current(self, stream: SimStream) -> None:
        self._local.stream = stream

    def current_stream(self) -> SimStream:
        s = getattr(self._local, "stream", None)
        if s is None:
            s = self._local.stream = self.new_stream(f"idle-{threading.current_thread().name}")
        return s

    def new_event(self) -> SimEvent:
        return SimEvent(self)

    def record(self, event: SimEvent, stream: SimStream) -> None:
        flag = threading.Event()
        event._flag = flag
        stream.enqueue(flag.set)

    def wait_event(self, stream: SimStream, event: SimEvent) -> None:
        flag = event._flag
        if flag is None:
            return

        def wait() -> None:
            if not flag.wait(self.timeout_s):
                raise TimeoutError(f"{stream.name} waited {self.timeout_s}s for an event")

        stream.enqueue(wait)

    def launch(self, stream: SimStream, fn: Callable[[], None]) -> None:
        stream.enqueue(fn)

    def synchronize(self) -> None:
        for s in list(self._streams):
            e = SimEvent(self)
            self.record(e, s)
            e.synchronize()
        self._raise()

    # --- memory -------------------------------------------------------------------------------
    def _register(self, t: torch.Tensor, kind: str) -> torch.Tensor:
        with self._lock:
            self._memory[t.untyped_storage().data_ptr()] = (weakref.ref(t), kind)
        return t

    def _kind(self, t: torch.Tensor) -> str:
        ptr = t.untyped_storage().data_ptr()
        with self._lock:
            entry = self._memory.get(ptr)
            if entry is not None and entry[0]() is None:
                del self._memory[ptr]  # freed; the address may now be ordinary memory
                entry = None
        return entry[1] if entry is not None else "pageable"

    def device_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Declare ``t`` (kept alive by the caller) device memory."""
        return self._register(t, "device")

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self._register(torch.zeros(tuple(shape), dtype=dtype), "device")

    def scratch(self, shape: Sequence[int], dtype: torch.dtype, stream: SimStream) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= int(n)
        nbytes = numel * dtype.itemsize
        size = nbytes or 8  # an empty tensor still gets a block (of any dtype's multiple)
        mem = self._reuse(stream, size)
        if mem is None:
            # Poisoned, not zeroed: reading it before it is written must not look like zeros.
            mem = np.full(size, 0xA5, dtype=np.uint8)
        t = torch.frombuffer(mem, dtype=dtype)[:numel].view(tuple(shape))
        storage = t.untyped_storage()
        with self._lock:
            self._scratch[storage.data_ptr()] = (mem, set())
        weakref.finalize(storage, self._freed.put, (stream, storage.data_ptr()))
        return self._register(t, "device")

    def keep(self, t: torch.Tensor, stream: SimStream) -> None:
        with self._lock:
            entry = self._scratch.get(t.untyped_storage().data_ptr())
            if entry is not None:
                entry[1].add(stream)

    def _reuse(self, stream: SimStream, nbytes: int) -> np.ndarray | None:
        """Memory of ``nbytes`` let go of on ``stream`` that no kept stream still needs."""
        while True:  # what the host let go of since the last call joins the pool
            try:
                owner, ptr = self._freed.get_nowait()
            except queue.Empty:
                break
            with self._lock:
                mem, kept = self._scratch.pop(ptr)
            # Recorded when the pool learns of the free, not at it: later, so never unsafe.
            events = []
            for s in kept:
                e = SimEvent(self)
                self.record(e, s)
                events.append(e)
            with self._lock:
                self._pool.setdefault(owner, []).append((mem, events))
        with self._lock:
            blocks = self._pool.get(stream, [])
            for i, (mem, events) in enumerate(blocks):
                if mem.nbytes == nbytes and all(e.query() for e in events):
                    return blocks.pop(i)[0]
        return None

    def _alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` over its scratch memory through a storage of its own: a queued copy holding
        the alias does not keep the scratch allocated (a queued kernel does not on a GPU)."""
        with self._lock:
            entry = self._scratch.get(t.untyped_storage().data_ptr())
        if entry is None or t.numel() == 0:
            return t
        base = torch.frombuffer(entry[0], dtype=t.dtype)
        return base.as_strided(t.size(), t.stride(), t.storage_offset())

    def pinned(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return self._register(torch.empty(tuple(shape), dtype=dtype), "pinned")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return self.pinned((nbytes,), torch.uint8)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return self._kind(t) == "pinned"

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        kinds = {self._kind(dst), self._kind(src)}
        if "device" not in kinds:
            raise ValueError(f"copy between two host tensors ({kinds}) is not a device copy")

        dst_a, src_a = self._alias(dst), self._alias(src)

        def op() -> None:
            dst_a.copy_(src_a)

        if "pageable" not in kinds:
            stream.enqueue(op)
            return
        # Pageable host memory: the call returns only once the copy ran.
        done = SimEvent(self)
        with self._lock:
            self.pageable_copies += 1
        stream.enqueue(op)
        self.record(done, stream)
        done.synchronize()

    # --- failure --------------------------------------------------------------------------------
    def _fail(self, exc: BaseException, where: str) -> None:
        with self._lock:
            if self._error is None:
                self._error = RuntimeError(f"simulated stream {where} failed: {exc!r}")
                self._error.__cause__ = exc

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        for s in list(self._streams):
            s.close()
        self._raise()

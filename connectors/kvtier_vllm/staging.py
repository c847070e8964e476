"""A byte-bounded, preallocated pool of host buffers for device copies (saves and restores).

One slot holds one chunk: ``(L, P, C, H, D)`` captured for a save, or an encoded chunk read from
the store for a restore (``slot_bytes`` then leaves room for the header). The pool is
``max_bytes // slot_bytes`` slots allocated once (pinned on a GPU host, so host<->device copies
are asynchronous), never grown. Why bounded: a pinned buffer per job, cached forever, reaches
hundreds of GiB under a queue of long prefills, and an allocation failure inside the engine's
hooks would kill the engine. When the pool runs short the caller falls back (a save keeps the
leading chunks it got slots for; a restore loads into pageable memory) and counts it.

``head`` (saves): bytes left free in front of each slot's chunk, where the saver writes the
chunk header, so that the slot itself becomes the stored chunk (``framed``); slots then start on
page boundaries (what the disk tier's O_DIRECT writes want).

Threads: any thread may call any method. A slot is never handed out twice while its bytes may
still be written or read: ``give`` once the caller's copies are done on the host side, and
``give_after(slots, fence)`` when a device copy may still read them: the slots stay out until
``fence.query()`` is true (checked by later ``take`` / ``free`` calls; nothing spins).
Failure: none (an empty pool returns no slots).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvtier.chunk import PAGE


class Done(Protocol):
    def query(self) -> bool:
        """True once the device work the slots were handed to has finished with them."""


class StagingPool:
    def __init__(self, max_bytes: int, chunk_shape: Sequence[int], dtype: torch.dtype,
                 alloc: Callable[[int], torch.Tensor], slot_bytes: int | None = None, head: int = 0) -> None:
        """``alloc(nbytes)`` returns a uint8 host tensor of ``nbytes`` (pinned where it matters);
        ``slot_bytes`` (default: ``head`` + one chunk's bytes, rounded up to whole pages when
        ``head``) may be larger, never smaller. ``head``: see the module docstring (a multiple
        of the dtype's size)."""
        numel = 1
        for n in chunk_shape:
            numel *= int(n)
        self.chunk_shape = tuple(int(n) for n in chunk_shape)
        self.dtype = dtype
        self.chunk_bytes = numel * dtype.itemsize
        if head < 0 or head % dtype.itemsize:
            raise ValueError(f"head {head} is not a multiple of the {dtype.itemsize}-byte dtype")
        self.head = head
        need = head + self.chunk_bytes
        if slot_bytes is not None and slot_bytes < need:
            raise ValueError(f"slot_bytes {slot_bytes} is smaller than a {need}-byte slot")
        self.slot_bytes = (-(-need // PAGE) * PAGE if head else need) if slot_bytes is None else slot_bytes
        self.slots = max_bytes // self.slot_bytes if self.slot_bytes else 0
        align = PAGE if head else 0  # over-allocate one page to start the first slot on one
        raw = alloc(self.slots * self.slot_bytes + align) if self.slots else alloc(0)
        self._alloc = raw  # the allocation itself stays referenced (views alone may not keep a
        # simulated device's registration, or an owner's mapping, alive)
        if self.slots:
            off = -raw.data_ptr() % PAGE if align else 0
            self._raw: torch.Tensor | None = raw[off:off + self.slots * self.slot_bytes].view(self.slots, self.slot_bytes)
        else:
            self._raw = None
        self._free = list(range(self.slots - 1, -1, -1))
        self._pending: list[tuple[list[int], Done]] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer, possibly none, when the pool is short)."""
        with self._lock:
            self._reap()
            k = min(n, len(self._free))
            got = [self._free.pop() for _ in range(k)]
        return got

    def raw(self, slot: int) -> torch.Tensor:
        """The slot's ``slot_bytes`` as a uint8 tensor (views of it share its pinned memory)."""
        assert self._raw is not None
        return self._raw[slot]

    def payload(self, slot: int) -> torch.Tensor:
        """The slot's bytes after its ``head`` (uint8): where a chunk's K/V goes."""
        return self.raw(slot)[self.head:]

    def tensor(self, slot: int) -> torch.Tensor:
        """The slot's ``chunk_bytes`` after its ``head`` as one chunk ``(L, P, C, H, D)``."""
        return self.payload(slot)[: self.chunk_bytes].view(self.dtype).view(self.chunk_shape)

    def framed(self, slot: int) -> memoryview:
        """The slot's ``head`` + ``chunk_bytes`` (writable): a chunk buffer with room for its
        header in front of the K/V that ``tensor(slot)`` views."""
        return self.raw(slot)[: self.head + self.chunk_bytes].numpy().data

    def view_of(self, slot: int, payload: memoryview | bytes | bytearray) -> torch.Tensor | None:
        """``payload`` as a chunk tensor that views the slot's memory, when ``payload`` lies in
        that slot with the chunk's size and a dtype-aligned offset; else None (e.g. a payload a
        codec decompressed elsewhere)."""
        raw = self.raw(slot)
        mv = memoryview(payload)
        if mv.nbytes != self.chunk_bytes or not mv.c_contiguous:
            return None
        import numpy as np  # address of the payload's first byte

        addr = int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if mv.nbytes else 0
        off = addr - raw.data_ptr()
        if off < 0 or off + self.chunk_bytes > self.slot_bytes or off % self.dtype.itemsize:
            return None
        return raw[off:off + self.chunk_bytes].view(self.dtype).view(self.chunk_shape)

    def give(self, slots: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(slots)

    def give_after(self, slots: Sequence[int], fence: Done) -> None:
        """Return ``slots`` once ``fence`` completed (device copies still reading them)."""
        if not slots:
            return
        with self._lock:
            self._pending.append((list(slots), fence))
            self._reap()

    def _reap(self) -> None:
        keep: list[tuple[list[int], Done]] = []
        for slots, fence in self._pending:
            if fence.query():
                self._free.extend(slots)
            else:
                keep.append((slots, fence))
        self._pending = keep

    @property
    def free(self) -> int:
        with self._lock:
            self._reap()
            return len(self._free)

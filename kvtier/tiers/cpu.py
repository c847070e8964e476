"""Host-RAM tier: one preallocated arena of fixed-size slots, pinned when CUDA is present.

Why an arena: a fresh allocation per chunk costs 3-4x a copy on these machines (page faults
and zeroing), so the arena is allocated and pre-touched once at construction and the hot path
only copies: ``put`` copies the caller's bytes into a free slot, ``get_into`` copies a slot
into the caller's buffer. ``get`` allocates the returned ``bytes`` (a convenience path).

Capacity is ``capacity_bytes // slot_bytes`` slots; a chunk larger than one slot is refused
(``put`` -> False). ``usage().used_bytes`` counts the chunk bytes held, while fullness is
decided by slots (a slot holds one chunk whatever its length), so size ``slot_bytes`` to the
largest chunk the engine writes.

Threads
    Metadata (key map, free list, policy, ghosts) changes under the TierBase lock; the big
    copies run outside it. A slot being copied into by ``put`` is invisible until the copy is
    done and then published atomically; a slot being read by ``get``/``get_into`` carries a
    reader count, and a slot evicted, deleted or overwritten while read is *retired* (no new
    reader can find it) and goes back to the free list when its last reader leaves. So a reader
    never sees a slot reused under it, and one thread's copy never blocks another thread's
    lookups (the copy itself is a memcpy under the GIL).
Failure
    No I/O can fail here; the only refusals are a chunk larger than a slot and a tier whose
    every chunk is pinned (both ``put`` -> False).
Evict listener
    Called after the lock is released, with a copy of the evicted bytes (taken only when a
    listener is set).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.config import CpuTierConfig
from kvtier.pinned import HostRegion
from kvtier.policies import NothingToEvict, make_policy
from kvtier.tiers.base import BoundedTier, Entry, Miss, Probe, check_keys

log = logging.getLogger(__name__)


def _allocate_arena(nbytes: int, pin_memory: str, slot_bytes: int) -> tuple[Any, memoryview, bool]:
    """(owner, uint8 view, pinned): an anonymous mapping of exactly ``nbytes`` (page-aligned, so
    slots of page-multiple size can feed O_DIRECT writes without a bounce copy), registered with
    CUDA in slot-aligned pieces when CUDA is present (``kvtier.pinned``). Not torch's pinned
    allocator: it rounds up to a power of two (48 GiB would lock 64)."""
    region = HostRegion(nbytes, pin_memory, align=slot_bytes)
    if not region.pinned and pin_memory != "never":
        log.debug("cpu tier: arena of %d bytes is pageable memory", nbytes)
    return region, region.view, region.pinned


class CpuTier(BoundedTier):
    """See the module docstring for the threading and ownership rules."""

    def __init__(self, config: CpuTierConfig | None = None, name: str = "cpu") -> None:
        super().__init__()
        config = config or CpuTierConfig()
        if config.slot_bytes < 1 or config.capacity_bytes < config.slot_bytes:
            raise ValueError(
                f"cpu tier needs capacity_bytes ({config.capacity_bytes}) >= slot_bytes "
                f"({config.slot_bytes}) >= 1")
        self.name = name
        self.config = config
        self.slot_bytes = config.slot_bytes
        self.slots = config.capacity_bytes // config.slot_bytes
        self.capacity_bytes = self.slots * self.slot_bytes
        self.policy = make_policy(config.policy)
        self._owner, self._arena, self.pinned = _allocate_arena(self.capacity_bytes, config.pin_memory,
                                                                    self.slot_bytes)
        # Pre-touch: one write per page so the first put does not take page faults.
        np.frombuffer(self._arena, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
        self._map: dict[bytes, tuple[int, int]] = {}  # key -> (slot, length)
        self._free: list[int] = list(range(self.slots - 1, -1, -1))  # pop() takes slot 0 first
        self._readers = [0] * self.slots
        self._writing: set[int] = set()  # slots handed to an in-flight put copy
        self._retired: set[int] = set()  # unmapped slots still being read
        self._used = 0

    # --- slot bookkeeping (lock held) ---------------------------------------------------------
    def _release(self, slot: int) -> None:
        if self._readers[slot]:
            self._retired.add(slot)
        else:
            self._free.append(slot)

    def _unmap(self, key: bytes) -> bool:
        old = self._map.pop(key, None)
        if old is None:
            return False
        self._used -= old[1]
        self.policy.remove(key)
        self._release(old[0])
        return True

    def _take_slot(self, evicted: list[tuple[bytes, bytes]], want_data: bool) -> int | None:
        while not self._free:
            try:
                victim = self._pick_victim()
            except NothingToEvict:
                return None
            slot, length = self._map.pop(victim)
            if want_data:
                off = slot * self.slot_bytes
                evicted.append((victim, bytes(self._arena[off : off + length])))
            self._used -= length
            self._remember_evicted(victim)
            self._release(slot)
        return self._free.pop()

    def _acquire(self, key: bytes) -> tuple[int, int] | Miss:
        """Look ``key`` up and register a reader on its slot (lock held)."""
        hit = self._map.get(key)
        if hit is None:
            return self._absent(key)
        self._readers[hit[0]] += 1
        self.policy.access(key)
        return hit

    def _leave(self, slot: int) -> None:
        self._readers[slot] -= 1
        if not self._readers[slot] and slot in self._retired:
            self._retired.discard(slot)
            self._free.append(slot)

    # --- verbs ----------------------------------------------------------------------------------
    def _probe(self, keys: Sequence[bytes]) -> Probe:
        with self._lock:
            mapping = self._map
            for i, key in enumerate(keys):
                if key not in mapping:
                    return Probe(i, self._absent(key).reason)
            return Probe(len(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        check_keys(keys)
        self._check_open()
        out: list[bytes | Miss] = []
        for key in keys:
            with self._lock:
                self._check_open()
                hit = self._acquire(key)
            if isinstance(hit, Miss):
                out.append(hit)
                continue
            slot, length = hit
            try:
                off = slot * self.slot_bytes
                out.append(bytes(self._arena[off : off + length]))
            finally:
                with self._lock:
                    self._leave(slot)
        return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"get_into got {len(keys)} keys and {len(outs)} buffers")
        self._check_open()
        results: list[int | Miss] = []
        arena, slot_bytes = self._arena, self.slot_bytes
        for key, out in zip(keys, outs):
            with self._lock:
                self._check_open()
                hit = self._acquire(key)
            if isinstance(hit, Miss):
                results.append(hit)
                continue
            slot, length = hit
            try:
                if length > out.nbytes:
                    raise ValueError(f"buffer of {out.nbytes} bytes is too small for a {length}-byte chunk")
                off = slot * slot_bytes
                out[:length] = arena[off : off + length]
                results.append(length)
            finally:
                with self._lock:
                    self._leave(slot)
        return results

    @contextmanager
    def leased(self, key: bytes) -> Iterator[memoryview | Miss]:
        """A read-only view of ``key``'s chunk in the arena, for use inside the ``with`` block
        only (no copy: a server sends it straight to a socket). While leased the slot is never
        reused: a chunk evicted, deleted or overwritten meanwhile stays intact for this lease.
        Yields a :class:`Miss` when the key is absent. Any thread; keep leases short (a
        leased slot is unavailable to ``put``)."""
        check_keys([key])
        with self._lock:
            self._check_open()
            hit = self._acquire(key)
        if isinstance(hit, Miss):
            yield hit
            return
        slot, length = hit
        off = slot * self.slot_bytes
        try:
            yield self._arena[off : off + length].toreadonly()
        finally:
            with self._lock:
                self._leave(slot)

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        evicted: list[tuple[bytes, bytes]] = []
        results = [self._put_one(e, evicted) for e in entries]
        listener = self.evict_listener
        if listener is not None:
            for key, value in evicted:
                listener(key, value)
        return results

    def _put_one(self, e: Entry, evicted: list[tuple[bytes, bytes]]) -> bool:
        src = e.data if isinstance(e.data, (bytes, bytearray)) else memoryview(e.data).cast("B")
        length = len(src)
        with self._lock:
            self._check_open()
            if length > self.slot_bytes:
                return False
            slot = self._take_slot(evicted, self.evict_listener is not None)
            if slot is None:
                return False
            self._writing.add(slot)
        off = slot * self.slot_bytes
        try:
            self._arena[off : off + length] = src  # the copy, outside the lock
        except BaseException:
            with self._lock:
                self._writing.discard(slot)
                self._free.append(slot)
            raise
        with self._lock:
            self._writing.discard(slot)
            if self._closed:
                self._free.append(slot)
                return False
            self._unmap(e.key)  # overwrite: the old slot is released (or retired if read)
            self._map[e.key] = (slot, length)
            self._used += length
            self._forget_evicted(e.key)
            self.policy.insert(e.key, length, e.depth, e.parent)
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            self._check_open()
            return sum(1 for key in keys if self._unmap(key))

    def _entries(self) -> int:
        return len(self._map)

    def check(self) -> list[str]:
        with self._lock:
            problems: list[str] = []
            used_slots = [slot for slot, _ in self._map.values()]
            every = self._free + used_slots + list(self._writing) + list(self._retired)
            if len(every) != self.slots:
                problems.append(f"free {len(self._free)} + used {len(used_slots)} + writing "
                                f"{len(self._writing)} + retired {len(self._retired)} != {self.slots} slots")
            if len(set(every)) != len(every):
                problems.append("a slot is listed twice (free, used, writing or retired)")
            used = sum(length for _, length in self._map.values())
            if used != self._used:
                problems.append(f"used_bytes {self._used} != sum of chunk lengths {used}")
            if self._used > self.capacity_bytes:
                problems.append(f"used_bytes {self._used} > capacity {self.capacity_bytes}")
            if any(length > self.slot_bytes for _, length in self._map.values()):
                problems.append("a chunk is longer than its slot")
            if len(self.policy) != len(self._map) or any(k not in self.policy for k in self._map):
                problems.append(f"policy tracks {len(self.policy)} keys, tier holds {len(self._map)}")
            if any(r < 0 for r in self._readers):
                problems.append("negative reader count")
            return problems

    def _close(self) -> None:
        # Forget every chunk; the arena itself is freed when the tier object is dropped
        # (copies still in flight hold their own reference to it).
        with self._lock:
            for key in list(self._map):
                self._unmap(key)


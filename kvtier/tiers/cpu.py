"""Host-RAM tier: one preallocated arena of fixed-size slots, pinned when CUDA is present.

Why an arena: a fresh allocation per chunk costs 3-4x a copy on these machines (page faults
and zeroing), so the arena is allocated and pre-touched once at construction and the hot path
only copies: ``put`` copies the caller's bytes into a free slot, ``get_into`` copies a slot
into the caller's buffer. ``get`` allocates the returned ``bytes`` (a convenience path).

Capacity is ``capacity_bytes // slot_bytes`` slots; a chunk larger than one slot is refused
(``put`` -> False). A slot holds one chunk whatever its length: ``usage().used_bytes`` counts
whole slots (``capacity_bytes`` exactly when a put must evict), ``usage().chunk_bytes`` and the
lock-free ``used_bytes`` chunk bytes. Size ``slot_bytes`` to the engine's largest chunk.

Spare slots (``spare_slots``, kvtier-server)
    Slots beyond the capacity, only ever held by a put in flight: a full tier can still hand a
    slot to a chunk being received or copied (``reserve``), verified there, and evict for it
    only at ``commit`` (the tier never holds more than ``capacity_bytes // slot_bytes``
    chunks). So a chunk that is refused costs nothing, and a put into a full tier is one pass
    over its bytes. Memory: up to ``spare_slots`` more slots resident while puts run.

Threads
    Metadata (key map, free list, policy, ghosts) changes under the TierBase lock; the big
    copies run outside it. A slot being copied into by ``put`` is invisible until the copy is
    done and then published atomically; a slot being read by ``get``/``get_into`` carries a
    reader count, and a slot evicted, deleted or overwritten while read is *retired* (no new
    reader can find it) and goes back to the free list when its last reader leaves. So a reader
    never sees a slot reused under it, and one thread's copy never blocks another thread's
    lookups. ``put`` and ``get_into`` copy with :func:`kvtier.memcopy.copy_into`, which releases
    the GIL for large chunks: threads (kvtier-server's connections) copy at once, not in turn;
    ``put`` with streaming stores (the C loop's fence orders them before the slot is published).
Lazy arena (``lazy=True``, kvtier-server)
    Resident memory follows the chunks held, not the capacity: see kvtier.tiers.cpu_arena.
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
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.config import CpuTierConfig
from kvtier.memcopy import copy_into
from kvtier.policies import NothingToEvict, make_policy
from kvtier.tiers.arena_pages import remove_pages
from kvtier.tiers.base import BoundedTier, Entry, Miss, Probe, TierUsage, check_keys, leading_run
from kvtier.tiers.cpu_access import ArenaAccess, Reservation
from kvtier.tiers.cpu_arena import allocate_arena
from kvtier.tiers.cpu_warm import WarmSlots

log = logging.getLogger(__name__)


class CpuTier(ArenaAccess, WarmSlots, BoundedTier):
    """See the module docstring for the threading and ownership rules; ``lazy`` selects the
    lazily backed arena (see "Lazy arena" there)."""

    def __init__(self, config: CpuTierConfig | None = None, name: str = "cpu", *, lazy: bool = False,
                 shareable: bool = False, spare_slots: int = 0) -> None:
        super().__init__()
        config = config or CpuTierConfig()
        if config.slot_bytes < 1 or config.capacity_bytes < config.slot_bytes:
            raise ValueError(
                f"cpu tier needs capacity_bytes ({config.capacity_bytes}) >= slot_bytes "
                f"({config.slot_bytes}) >= 1")
        if lazy and config.pin_memory != "never":
            raise ValueError(f"cpu tier: a lazy arena is pageable memory; pin_memory must be 'never', "
                             f"got {config.pin_memory!r}")
        self.name = name
        self.config = config
        self.slot_bytes = config.slot_bytes
        self.slots = config.capacity_bytes // config.slot_bytes
        self.capacity_bytes = self.slots * self.slot_bytes
        self.spare_slots = max(0, spare_slots)
        self._physical = self.slots + self.spare_slots  # slots in the arena, spares included
        self.arena_bytes = self._physical * self.slot_bytes
        self.policy = make_policy(config.policy)
        self._owner, self.shared = allocate_arena(self.arena_bytes, config, self.slot_bytes, lazy,
                                                   shareable, name)
        self._arena, self.pinned = self._owner.view, self._owner.pinned
        # Pre-touch: one write per page so the first put does not take page faults.
        if not lazy:
            np.frombuffer(self._arena, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
        # A lazy arena is left untouched (see "Lazy arena" above).
        self.lazy = lazy
        self._base = np.frombuffer(self._arena, dtype=np.uint8).ctypes.data  # page-aligned (mmap)
        if lazy:  # fail here, not at the first eviction, should the kernel refuse the madvise
            remove_pages(self._base, mmap.PAGESIZE, self.shared)
        self._map: dict[bytes, tuple[int, int]] = {}  # key -> (slot, length)
        self._free: list[int] = list(range(self._physical - 1, -1, -1))  # pop() takes slot 0 first
        # Free slots that kept their pages for a put about to come (taken before ``_free``).
        self._warm: list[int] = []
        self._readers = [0] * self._physical
        self._writing: set[int] = set()  # slots handed to an in-flight put copy
        self._retired: set[int] = set()  # unmapped slots still being read
        self._used = 0
        # Called (lock held: keep it cheap) whenever a put takes a free slot, with whether the
        # slot was cold (its pages not faulted in): kvtier-server's warm-ahead thread refills
        # the warm slots puts draw on (kvtier.server.warm_ahead).
        self.take_listener: Callable[[bool], None] | None = None

    # --- slot bookkeeping (lock held) ---------------------------------------------------------
    def _release(self, slot: int, reuse: bool = False) -> None:
        """An unmapped slot goes back to the free list, or is retired while it is read.
        ``reuse``: a put takes it next, so it keeps its pages (``_warm``)."""
        if self._readers[slot]:
            self._retired.add(slot)
        elif reuse:
            self._warm.append(slot)
        else:
            self._free_slot(slot)

    def _free_slot(self, slot: int) -> None:
        """Free ``slot``; a lazy arena also returns the pages wholly inside it to the OS (a
        page shared with a neighbouring slot may hold that slot's live bytes, so it stays).
        Under the lock: no put can be copying into the slot and no reader holds it, so
        zero-filled pages are never seen by anyone."""
        self._free.append(slot)
        if self.lazy:
            start, end = self._whole_pages(slot)
            if end > start:
                remove_pages(self._base + start, end - start, self.shared)

    def _unmap(self, key: bytes, reuse: bool = False) -> bool:
        old = self._map.pop(key, None)
        if old is None:
            return False
        self._used -= old[1]
        self.policy.remove(key)
        self._release(old[0], reuse)
        return True

    def _evict_one(self, evicted: list[tuple[bytes, bytes]], want_data: bool, reuse: bool) -> int | None:
        """Evict the policy's next victim; its length, or None when nothing is evictable."""
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
        self._release(slot, reuse)
        return length

    def _take_slot(self, evicted: list[tuple[bytes, bytes]], want_data: bool) -> int | None:
        while not self._warm and not self._free:
            if self._evict_one(evicted, want_data, reuse=True) is None:
                return None
        return self._pop_slot()

    def _pop_slot(self) -> int | None:
        """A free slot for a put, warm ones first; None when there is none (lock held)."""
        if self._warm:
            slot, cold = self._warm.pop(), False
        elif self._free:
            slot, cold = self._free.pop(), True
        else:
            return None
        if self.take_listener is not None:
            self.take_listener(cold)
        return slot

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
            self._free_slot(slot)

    # --- verbs ----------------------------------------------------------------------------------
    def _probe(self, keys: Sequence[bytes]) -> Probe:
        with self._lock:
            # The leading run, counted at C speed (no per-key bytecode).
            hits = leading_run(self._map, keys)
            if hits < len(keys):
                return Probe(hits, self._absent(keys[hits]).reason)
            return Probe(hits)

    def holds(self, key: bytes) -> bool:
        """Whether ``key`` is held now: a snapshot, taken without the lock (one dict lookup is
        atomic) and not a read (the policy is not told, nothing is counted)."""
        return key in self._map

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
                copy_into(out[:length], arena[off : off + length])  # the GIL released meanwhile
                results.append(length)
            finally:
                with self._lock:
                    self._leave(slot)
        return results

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        evicted: list[tuple[bytes, bytes]] = []
        results = [self._put_one(e, evicted) for e in entries]
        self._notify(evicted)
        return results

    def shed(self, nbytes: int, reuse: bool = False) -> int:
        """Evict chunks in policy order until at least ``nbytes`` chunk bytes are freed or
        nothing evictable is left (pinned chunks stay); returns the chunk bytes freed. For an
        owner that shares one RAM budget among several tiers (kvtier-server's tenant pool); on
        a lazy arena the freed slots' pages go back to the OS (a slot still being read keeps
        them until its last reader leaves). ``reuse``: the caller is about to put about
        ``nbytes`` into this very tier, so the freed slots keep their pages for that put (a
        fresh page costs a fault and zeroing: a steady-state put would be several times
        slower); only the latest such shed's slots are kept, earlier ones' pages go back
        first, so at most one shed's worth of free slots stays resident. Evictions count in
        ``usage().evictions`` and reach the evict listener as a put's do. Any thread."""
        evicted: list[tuple[bytes, bytes]] = []
        freed = 0
        with self._lock:
            want_data = self.evict_listener is not None
            while self._warm:
                self._free_slot(self._warm.pop())
            while freed < nbytes:
                length = self._evict_one(evicted, want_data, reuse=reuse)
                if length is None:
                    break
                freed += length
        self._notify(evicted)
        return freed

    def _notify(self, evicted: list[tuple[bytes, bytes]]) -> None:
        listener = self.evict_listener
        if listener is not None:
            for key, value in evicted:
                listener(key, value)

    def _put_one(self, e: Entry, evicted: list[tuple[bytes, bytes]]) -> bool:
        src = e.data if isinstance(e.data, (bytes, bytearray)) else memoryview(e.data).cast("B")

        def copy(dst: memoryview) -> None:  # the GIL released; streaming: see "Threads" above
            copy_into(dst, src, streaming=True)

        return self._put(e.key, len(src), copy, e.depth, e.parent, evicted)

    def _put(self, key: bytes, length: int, fill: Callable[[memoryview], None], depth: int,
             parent: bytes, evicted: list[tuple[bytes, bytes]]) -> bool:
        res = self._reserve(length, evicted, evict=True)
        if res is None:
            return False
        try:
            fill(res.view)  # the copy, outside the lock
        except BaseException:
            self.abort(res)
            raise
        return self._commit(res, key, depth, parent, evicted)

    def _reserve(self, length: int, evicted: list[tuple[bytes, bytes]], evict: bool) -> Reservation | None:
        with self._lock:
            self._check_open()
            if length > self.slot_bytes:
                return None
            if evict:
                slot = self._take_slot(evicted, self.evict_listener is not None)
            else:
                slot = self._pop_slot()
            if slot is None:
                return None
            self._writing.add(slot)
        off = slot * self.slot_bytes
        return Reservation(slot, self._arena[off : off + length])

    def _commit(self, res: Reservation, key: bytes, depth: int, parent: bytes,
                evicted: list[tuple[bytes, bytes]]) -> bool:
        slot, length = res.slot, res.view.nbytes
        with self._lock:
            self._writing.discard(slot)
            if self._closed:
                self._free_slot(slot)
                return False
            # A spare slot was taken: the chunk is verified now, so the eviction it needs
            # happens here (its victim's slot kept warm for the next put), never for a refusal.
            while len(self._map) - (key in self._map) >= self.slots:
                if self._evict_one(evicted, self.evict_listener is not None, reuse=True) is None:
                    self._warm.append(slot)  # every chunk held is pinned: refused, as put is
                    return False
            # Overwrite: the old slot is released (or retired if read) and kept warm, since it
            # just replaced itself with a slot this put took: rewriting keys never faults.
            self._unmap(key, reuse=True)
            self._map[key] = (slot, length)
            self._used += length
            self._forget_evicted(key)
            self.policy.insert(key, length, depth, parent)
        return True

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            self._check_open()
            return sum(1 for key in keys if self._unmap(key))

    def _entries(self) -> int:
        return len(self._map)

    def usage(self) -> TierUsage:
        """``used_bytes``: the slots held, whole (see the module docstring); ``chunk_bytes``:
        the chunk bytes in them."""
        with self._lock:
            held = len(self._map)
            return TierUsage(self.name, held * self.slot_bytes, self.capacity_bytes, held,
                             self._evictions, chunk_bytes=self._used)

    @property
    def used_bytes(self) -> int:
        """``usage().chunk_bytes`` without the lock (a snapshot): what kvtier-server's RAM pool
        budgets, as a lazy arena's resident memory follows chunk bytes, not slots."""
        return self._used

    def check(self, idle: bool = False) -> list[str]:
        """The invariants; ``idle``: the caller knows no put is in flight (every connection
        closed), so a slot still handed to a put copy is a leak (capacity lost for good)."""
        with self._lock:
            problems: list[str] = []
            if idle and self._writing:
                problems.append(f"{len(self._writing)} slots still handed to puts with none in flight")
            used_slots = [slot for slot, _ in self._map.values()]
            every = self._free + self._warm + used_slots + list(self._writing) + list(self._retired)
            if len(every) != self._physical:
                problems.append(f"free {len(self._free)} + warm {len(self._warm)} + used {len(used_slots)} + "
                                f"writing {len(self._writing)} + retired {len(self._retired)} != {self._physical} slots")
            if len(self._map) > self.slots:
                problems.append(f"{len(self._map)} chunks held in {self.slots} slots of capacity")
            if len(set(every)) != len(every):
                problems.append("a slot is listed twice (free, warm, used, writing or retired)")
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

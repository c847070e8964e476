"""Warm slots of a :class:`~kvtier.tiers.cpu.CpuTier`'s lazy arena: free slots whose pages
are faulted in before a put needs them (kvtier-server's warm-ahead thread drives these,
:mod:`kvtier.server.warm_ahead`), given back when the room they hold is wanted, and the page
range a slot owns (which ``cpu.py`` also frees).

The free and warm lists themselves, and the lock, stay in ``cpu.py``; the threading and
ownership rules are that module's.
"""

from __future__ import annotations

import mmap
import threading
from typing import TYPE_CHECKING

from kvtier.tiers.arena_pages import populate_pages


class WarmSlots:
    """Mixed into ``CpuTier``; every method takes the tier's lock itself."""

    if TYPE_CHECKING:  # provided by CpuTier
        _lock: threading.RLock
        _free: list[int]
        _warm: list[int]
        _base: int
        _closed: bool
        lazy: bool
        slot_bytes: int

        def _free_slot(self, slot: int) -> None: ...

    @property
    def warm_bytes(self) -> int:
        """Bytes of free slots whose pages are kept for the puts to come (resident, not
        counted in ``used_bytes``). Read without the lock: a snapshot."""
        return len(self._warm) * self.slot_bytes

    @property
    def has_cold_slot(self) -> bool:
        """Whether a free slot is left whose pages are not faulted in (something for
        :meth:`warm_ahead` to do). A snapshot."""
        return bool(self._free)

    def warm_ahead(self) -> int:
        """Lazy arena: fault in the pages of the free slot the next cold put would take, before
        that put comes, and keep the slot warm; returns the bytes made warm, 0 when no free slot
        is cold (or a put took this one meanwhile; its pages then served that put). The tier
        lock is not held while the pages fault in, and no byte already in the slot changes
        (``arena_pages.populate_pages``), so a put writing into the slot meanwhile loses nothing.
        Raises ``arena_pages.PopulateUnsupported`` on a kernel without ``MADV_POPULATE_WRITE``,
        OSError when the kernel refuses the pages. Any thread (one at a time per tier)."""
        with self._lock:
            if not self.lazy or self._closed or not self._free:
                return 0
            slot = self._free[-1]  # what the next cold put pops
        start, end = self._whole_pages(slot)
        if end > start:
            populate_pages(self._base + start, end - start)
        with self._lock:
            if self._closed or not self._free or self._free[-1] != slot:
                return 0
            self._warm.append(self._free.pop())
        return self.slot_bytes

    def cool_one(self) -> int:
        """Give one warm free slot's pages back to the OS; returns the bytes given back (0: no
        warm slot). For kvtier-server's warm-ahead, when the chunks held have grown into the
        room its warm slots took. Any thread."""
        with self._lock:
            if not self.lazy or not self._warm:
                return 0
            self._free_slot(self._warm.pop(0))  # the oldest: the next put takes the newest
        return self.slot_bytes

    def _whole_pages(self, slot: int) -> tuple[int, int]:
        """Arena offsets of the pages wholly inside ``slot`` (a page shared with a neighbouring
        slot may hold that slot's live bytes)."""
        off = slot * self.slot_bytes
        start = -(-off // mmap.PAGESIZE) * mmap.PAGESIZE
        return start, (off + self.slot_bytes) // mmap.PAGESIZE * mmap.PAGESIZE

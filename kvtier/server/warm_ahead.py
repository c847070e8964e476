"""Warm-ahead: a thread that faults in free RAM slots before the puts that will take them.

Why: each tenant's RAM arena is lazily backed (:mod:`kvtier.server.storage`), so until the
server has used its RAM once, every put copies into never-touched memory and takes a page
fault per 4 KiB, which costs more than the copy (``python bench/cpu_lazy.py``). Once the
budget is full, puts reuse the pages of the slots they evict and this cost is gone; it is the
first pass over the RAM, and every slot freed by a delete or by another tenant's eviction,
that pays it. This thread pays it instead, off the request path: whenever a put leaves its
tenant with less than half its share of the reserve warm, it is woken, and it faults in the
free slots the next puts will take
(:meth:`~kvtier.tiers.cpu.CpuTier.warm_ahead`, one ``MADV_POPULATE_WRITE`` per slot, which
is also faster than the faults themselves) until ``cpu.warm_ahead_bytes`` of free slots are
warm, server-wide.

Memory: warm free slots are resident but hold no chunk. The thread only warms a slot while
the RAM budget has room for it on top of the chunks held and the slots already warm
(``SharedPool.room()``), never more than ``warm_ahead_bytes`` in all, and when the chunks
held grow into that room it gives warm slots back, so resident memory stays within
``cpu.capacity_bytes`` (plus the pool's own bound, :mod:`kvtier.server.pool`) but for the
puts between two wake-ups.
A warm slot is drawn on by its own tenant only: at start every tenant's arena gets its turn,
then the tenants whose puts took slots, one slot each in turn; another tenant's eviction
(``shed``) hands a tier's warm slots back to the OS first.

Cost to the put path: one call per slot taken (a comparison). A put that takes a warm slot
does not wake the thread while its tenant's warm slots are above half its share (overwrites
and evictions keep their slots warm by themselves) nor while the budget is full (it then
looks for room every ``POLL_S``) nor when the tenant has no cold slot left (at its cap, it
evicts its own chunks and reuses their pages): a wake-up per put cost the server ~10-20 us of CPU per chunk
in a small-PUT loop. A put that takes a cold slot (its faults cost far more) always does.

Failure: a kernel without ``MADV_POPULATE_WRITE`` (before Linux 5.14) turns warm-ahead off,
with one log line; a refused populate (no memory) is logged and the thread waits for the
next wake-up. Puts never wait for this thread and behave the same without it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from kvtier.server.pool import SharedPool
from kvtier.tiers.arena_pages import PopulateUnsupported
from kvtier.tiers.cpu import CpuTier

log = logging.getLogger(__name__)

POLL_S = 1.0  # a full budget: how often the thread looks for room a delete may have made


class WarmAhead:
    """Owns one daemon thread over ``tiers`` (the tenants' lazy RAM arenas, all in ``pool``).
    :meth:`close` stops it; it also stops by itself when the kernel cannot populate."""

    def __init__(self, tiers: Sequence[CpuTier], pool: SharedPool, reserve_bytes: int) -> None:
        self.tiers = list(tiers)
        self.pool = pool
        self.reserve_bytes = reserve_bytes
        self._low_bytes = reserve_bytes // (2 * max(1, len(self.tiers)))
        self._spare_bytes = sum(t.spare_slots * t.slot_bytes for t in self.tiers)  # warm beyond the budget
        self.warmed_bytes = 0  # bytes faulted in ahead of puts so far (what puts were spared)
        self.wakeups = 0  # times a put (or start, or close) woke the thread
        self._wanted: set[int] = set(range(len(self.tiers)))  # a tenant's first put finds warm slots
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._starved = False  # the last fill stopped for want of room in the budget
        for i, tier in enumerate(self.tiers):
            tier.take_listener = lambda cold, i=i: self._wanted_by(i, cold)
        self._thread = threading.Thread(target=self._run, name="kvtier-warm-ahead", daemon=True)
        self._thread.start()
        self._wake.set()

    def _wanted_by(self, index: int, cold: bool) -> None:
        """A put took a slot of tier ``index``, ``cold`` when its pages were not faulted in
        (its tier lock held: only flag and wake). A warm take wakes nobody while the tier
        keeps at least half its share of the reserve warm (overwrites and evictions keep
        their slots warm by themselves; a wake-up per put costs the server ~10-20 us of CPU:
        a context switch and the GIL), nor while the budget is full (the thread then looks
        for room every POLL_S), nor when the tier has no cold slot left to warm (a tenant at
        its cap evicts its own chunks and reuses their pages). A cold take always wakes it:
        resident memory grew, and other tenants' warm slots may have to give way."""
        tier = self.tiers[index]
        if not cold and (self._starved or tier.warm_bytes >= self._low_bytes or not tier.has_cold_slot):
            return
        with self._lock:
            self._wanted.add(index)
        self._wake.set()

    def warm_bytes(self) -> int:
        """Bytes of free slots kept faulted in now, every tenant's (a snapshot)."""
        return sum(t.warm_bytes for t in self.tiers)

    def close(self) -> None:
        self._stop = True
        for tier in self.tiers:
            tier.take_listener = None
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop:
            woken = self._wake.wait(POLL_S if self._starved else None)
            self._wake.clear()
            self.wakeups += woken
            with self._lock:
                wanted, self._wanted = self._wanted, set()
            if not woken:  # starved, and nobody asked meanwhile: has a delete made room?
                wanted = set(range(len(self.tiers)))
            try:
                self._starved = self._fill([self.tiers[i] for i in sorted(wanted)])
            except PopulateUnsupported as e:
                log.info("warm-ahead off: the kernel cannot populate pages ahead of puts (%s); "
                         "puts into fresh RAM fault their pages in themselves", e)
                return
            except OSError as e:
                log.warning("warm-ahead: faulting in a free RAM slot was refused (%s); "
                            "trying again at the next put", e)

    def _fill(self, tiers: list[CpuTier]) -> bool:
        """Warm the next free slots of ``tiers``, one slot each in turn (so tenants that put
        at once share the reserve), while the reserve and the budget have room; first, when
        the chunks held have grown into the room warm slots took, give slots back (the
        tenant with the most warm first) until the warm ones fit again, the tiers' spare
        slots aside (a full tier's puts reuse their victims' slots: kvtier.tiers.cpu, "Spare
        slots"). True when it stopped for want of room in the budget."""
        while not self._stop:
            excess = self.warm_bytes() - max(0, self.pool.room()) - self._spare_bytes
            if excess <= 0 or not max(self.tiers, key=lambda t: t.warm_bytes).cool_one():
                break
        starved = False
        while tiers and not self._stop:
            for tier in list(tiers):
                warm = self.warm_bytes() + tier.slot_bytes
                starved = warm > self.pool.room()
                made = tier.warm_ahead() if warm <= self.reserve_bytes and not starved else 0
                if made:
                    self.warmed_bytes += made
                else:
                    tiers.remove(tier)
        return starved

"""Zero-copy access to a :class:`~kvtier.tiers.cpu.CpuTier`'s arena, for callers that would
otherwise copy a chunk only to have it copied again: leases (read-only views of stored chunks,
which kvtier-server sends straight to a socket), holds (a lease without a ``with`` block: the
slot a reader in another process copies from, through a shareable arena's ``reader_fd``) and
reservations (a slot written in place, then
published: the server receives a PUT body into it; SGLang's backend frames a page into it).

The slot bookkeeping these build on (``_acquire``/``_leave``, ``_reserve``/``_commit``, the
lock) stays in ``cpu.py``; the threading and ownership rules are that module's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.tiers.base import Miss, check_keys

if TYPE_CHECKING:
    from kvtier.pinned import HostRegion


@dataclass(frozen=True)
class Reservation:
    """A slot taken for a chunk being written in place (:meth:`CpuTier.reserve`): ``view`` is
    the slot's first ``length`` bytes, writable, and seen by no reader until committed."""

    slot: int
    view: memoryview


class ArenaAccess:
    """Mixed into ``CpuTier``; every method takes the tier's lock itself. Any thread."""

    if TYPE_CHECKING:  # provided by CpuTier
        _lock: threading.RLock
        _arena: memoryview
        _owner: HostRegion
        shared: bool
        slot_bytes: int
        _writing: set[int]
        _warm: list[int]
        _map: dict[bytes, tuple[int, int]]
        slots: int

        def _check_open(self) -> None: ...
        def _acquire(self, key: bytes) -> tuple[int, int] | Miss: ...
        def _leave(self, slot: int) -> None: ...
        def _free_slot(self, slot: int) -> None: ...
        def _notify(self, evicted: list[tuple[bytes, bytes]]) -> None: ...
        def _reserve(self, length: int, evicted: list[tuple[bytes, bytes]], evict: bool) -> Reservation | None: ...
        def _commit(self, res: Reservation, key: bytes, depth: int, parent: bytes,
                    evicted: list[tuple[bytes, bytes]]) -> bool: ...
        def _put(self, key: bytes, length: int, fill: Callable[[memoryview], None], depth: int,
                 parent: bytes, evicted: list[tuple[bytes, bytes]]) -> bool: ...

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

    @contextmanager
    def leased_many(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | Miss]]:
        """:meth:`leased` for several keys at once, under one lock hold (a server sends the
        views with one ``sendmsg``): per key a read-only view or a :class:`Miss`, every slot
        leased until the ``with`` block ends. The same rules as :meth:`leased`; a caller bounds
        how many slots it holds at once (each is unavailable to ``put`` meanwhile)."""
        check_keys(keys)
        with self._lock:
            self._check_open()
            hits = [self._acquire(key) for key in keys]
        arena, slot_bytes = self._arena, self.slot_bytes
        try:
            yield [hit if isinstance(hit, Miss)
                   else arena[hit[0] * slot_bytes : hit[0] * slot_bytes + hit[1]].toreadonly() for hit in hits]
        finally:
            with self._lock:
                for hit in hits:
                    if not isinstance(hit, Miss):
                        self._leave(hit[0])

    def hold(self, keys: Sequence[bytes]) -> list[tuple[int, int, int] | Miss]:
        """Per key ``(slot, offset, length)``: where its chunk lies in the arena, the slot held
        (never reused, whatever happens to the key) until :meth:`release` gives it back; or a
        :class:`Miss`. For a reader that copies from the arena outside this call (another
        process, through :meth:`reader_fd`); every hold must be released."""
        check_keys(keys)
        out: list[tuple[int, int, int] | Miss] = []
        with self._lock:
            self._check_open()
            for key in keys:
                hit = self._acquire(key)
                out.append(hit if isinstance(hit, Miss) else (hit[0], hit[0] * self.slot_bytes, hit[1]))
        return out

    def release(self, slots: Sequence[int]) -> None:
        """Give back slots :meth:`hold` returned (each once per hold)."""
        with self._lock:
            for slot in slots:
                self._leave(slot)

    def reader_fd(self) -> int:
        """A new read-only descriptor of a shareable arena (``CpuTier(shareable=True)``; the
        caller closes it): mapped by another process, slot ``s`` lies at ``s * slot_bytes``.
        Raises ValueError when the arena is not shareable, OSError when no descriptor can be
        made."""
        if not self.shared:
            raise ValueError("cpu tier: this arena is not shareable")
        return self._owner.reader_fd()

    def put_in_place(self, key: bytes, length: int, fill: Callable[[memoryview], None],
                     depth: int = 0, parent: bytes = b"") -> bool:
        """Store a ``length``-byte chunk that ``fill(view)`` writes straight into its arena slot
        (a writable view of exactly ``length`` bytes): the put without the copy from a caller's
        buffer, for callers that would only build the chunk to have it copied here. False when
        the chunk cannot fit a slot (as ``put``). ``fill`` runs outside the tier lock; if it
        raises, the slot is freed, nothing is stored and the exception propagates."""
        check_keys([key])
        evicted: list[tuple[bytes, bytes]] = []
        try:
            return self._put(key, length, fill, depth, parent, evicted)
        finally:
            self._notify(evicted)  # victims are gone whether or not ``fill`` succeeded

    def reserve(self, length: int) -> Reservation | None:
        """A free slot for a chunk of ``length`` bytes that the caller writes in place
        (kvtier-server receives a PUT body straight into it: no copy). Never evicts: the
        bytes are not verified yet, and a chunk refused later must have cost nothing; None
        when no slot is free or the chunk does not fit one (the caller then verifies first
        and puts). A full tier with spare slots hands out a spare: the eviction it needs
        happens at :meth:`commit`. The slot is invisible to readers until :meth:`commit`;
        :meth:`abort` gives it back. Either must follow (a reservation left open keeps its
        slot out of use)."""
        return self._reserve(length, [], evict=False)

    @property
    def full(self) -> bool:
        """Whether the chunks held and the puts in flight take every slot of capacity (a
        reservation now is a spare slot's, and its commit evicts). A snapshot, no lock."""
        return len(self._map) + len(self._writing) >= self.slots

    def commit(self, res: Reservation, key: bytes, depth: int = 0, parent: bytes = b"") -> bool:
        """Publish the chunk written into ``res`` under ``key`` (replacing what ``key`` held),
        first evicting in policy order when the tier holds a full capacity of chunks (a spare
        slot's reservation); False (slot freed) when the tier was closed meanwhile or nothing
        is evictable."""
        check_keys([key])
        evicted: list[tuple[bytes, bytes]] = []
        try:
            return self._commit(res, key, depth, parent, evicted)
        finally:
            self._notify(evicted)

    def abort(self, res: Reservation) -> None:
        """Give back a reserved slot unpublished (its bytes are never read). It keeps its
        pages for the put that follows (as an overwritten slot does): the server reserves
        slots ahead of the chunks it receives and gives back the ones a batch did not use,
        which would otherwise fault their pages in again on the next batch."""
        with self._lock:
            self._writing.discard(res.slot)
            self._warm.append(res.slot)  # no reader can hold it: it was never published

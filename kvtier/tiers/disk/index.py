"""The disk tier's index and space accounting: which chunk files this tier counts, their
bytes, the eviction policy, and how room is made (evict, reuse a victim's file, ENOSPC).

:class:`DiskIndex` is the base of :class:`~kvtier.tiers.disk.DiskTier`, which adds the read
and write paths. The index maps key -> size of its file; ``_used`` is their sum, bounded by
``capacity_bytes`` together with ``_reserved`` (bytes promised to puts whose files are being
written). Start-up (:meth:`DiskIndex._rebuild`) fills it from the directory scan, oldest
file first, evicting down to capacity.

Threads: methods marked "lock held" run under the TierBase lock and only decide; the slow
part (unlinks, which can take milliseconds on a ``discard`` mount, and the evict listener)
is collected in a :class:`Pending` and done by :meth:`DiskIndex._finish` after the lock is
released. A victim's file is never reused while this process reads it (``_readers``).
Adoption (indexing a file another process wrote, found by a read or a probe) must never take
back a key this tier itself just dropped: ``_leaving`` counts the keys whose files this tier is
removing (evicted or deleted, unlink not yet done), ``_dropped_reads`` the keys dropped while a
read of theirs was in flight; neither is adopted (it would index a file that is gone, and evict
a real chunk to make room for it).
Failure: a file a sharer already removed is simply not reused or unlinked; nothing here
raises for the medium.
"""

from __future__ import annotations

import os
import time
from collections import Counter

from kvtier.policies import NothingToEvict, make_policy
from kvtier.tiers.base import BoundedTier, Miss
from kvtier.tiers.disk import direct_io as io
from kvtier.tiers.disk.layout import RebuildStats, chunk_path, scan

__all__ = ["DiskIndex", "Pending"]


class Pending:
    """Work decided under the lock and done after it: files to unlink (an unlink can take
    milliseconds on a ``discard`` mount) and evicted chunks for the listener."""

    __slots__ = ("doomed", "evicted", "left")

    def __init__(self) -> None:
        self.doomed: list[str] = []
        self.evicted: list[tuple[bytes, bytes]] = []
        self.left: list[bytes] = []  # evicted keys: ``_leaving`` until their files are gone


class DiskIndex(BoundedTier):
    """Index, byte counts and eviction of a disk tier rooted at ``root``; subclasses provide
    :meth:`_read` (the evict listener is handed the victim's verified bytes)."""

    def __init__(self, root: str, capacity_bytes: int, policy: str) -> None:
        super().__init__()
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy)
        self._index: dict[bytes, int] = {}  # key -> size of its file on disk
        self._readers: dict[bytes, int] = {}  # key -> reads in flight (its file is not reused)
        self._leaving: Counter[bytes] = Counter()  # keys whose files this tier is removing
        self._dropped_reads: set[bytes] = set()  # keys dropped while read (never adopted by it)
        self._used = 0
        self._reserved = 0  # bytes promised to puts whose files are being written

    def _read(self, key: bytes, out: memoryview | None, victim: bool = False) -> memoryview | Miss:
        """Read and verify ``key``'s chunk (see DiskTier); called under the lock for the
        evict listener with ``victim=True`` (never adopted; into a buffer of its own, as the
        read that made room may still hold its bytes in this thread's scratch)."""
        raise NotImplementedError

    # --- start-up -----------------------------------------------------------------------------
    def _rebuild(self) -> RebuildStats:
        start = time.monotonic()
        found, bad, tmp_removed = scan(self.root)
        pending = Pending()
        with self._lock:
            for f in found:  # with the parent each chunk's put gave (lineage.py), if kept
                self._index[f.key] = f.size
                self._used += f.size
                self.policy.insert(f.key, f.size, f.depth, f.parent)
            while self._used > self.capacity_bytes and (victim := self._evict_one(pending)):
                pending.doomed.append(self._path(victim[0]))
        self._finish(pending)
        return RebuildStats(len(found), self._used, bad, tmp_removed, len(pending.doomed),
                            time.monotonic() - start)

    # --- bookkeeping (lock held unless said otherwise) ---------------------------------------
    def _path(self, key: bytes) -> str:
        return chunk_path(self.root, key)

    def _evict_one(self, p: Pending) -> tuple[bytes, int] | None:
        """Take the policy's victim out of the index: (key, file size), or None when nothing
        can be evicted. The caller decides the file's fate (unlink or reuse)."""
        try:
            victim = self._pick_victim()
        except NothingToEvict:
            return None
        if self.evict_listener is not None:
            value = self._read(victim, None, victim=True)
            if isinstance(value, memoryview):
                p.evicted.append((victim, bytes(value)))
        size = self._index.pop(victim, 0)  # 0: the listener's read found it corrupt
        self._used -= size
        self._remember_evicted(victim)
        self._leave(victim)
        p.left.append(victim)
        return victim, size

    def _make_room(self, size: int, p: Pending, reuse_as: str | None = None) -> int | None:
        """Evict until ``size`` more bytes fit. With ``reuse_as``, the first victim's file is
        renamed there for the caller to overwrite (no unlink, no block allocation). Returns
        that file's size (0 if none), or None when no room can be made."""
        reused = 0
        if size > self.capacity_bytes:
            return None
        need = self._used + self._reserved + size > self.capacity_bytes
        if need and self._pins and self._unfittable(size):
            return None
        while self._used + self._reserved + size > self.capacity_bytes:
            victim = self._evict_one(p)
            if victim is None:
                if reused and reuse_as is not None:
                    p.doomed.append(reuse_as)
                return None
            key, vsize = victim
            path = self._path(key)
            if reuse_as is not None and not reused and vsize and not self._readers.get(key):
                try:
                    os.rename(path, reuse_as)
                    reused = vsize
                    continue
                except OSError:
                    pass  # a sharer removed it: nothing to reuse
            p.doomed.append(path)
        return reused

    def _free_for_nospace(self, size: int) -> None:
        """Lock NOT held. The file system is fuller than our own count says (ENOSPC): evict
        at least ``size`` bytes of this tier's files, whatever the capacity, and unlink them."""
        pending = Pending()
        with self._lock:
            freed = 0
            while freed < size and (victim := self._evict_one(pending)) is not None:
                pending.doomed.append(self._path(victim[0]))
                freed += victim[1]
        self._finish(pending)

    def shed(self, nbytes: int, reuse: bool = False) -> int:
        """Evict chunks (policy order) until at least ``nbytes`` are freed or nothing is left;
        returns the bytes freed. For an owner that shares one budget among several tiers
        (kvtier-server's tenant pool). ``reuse`` (a put into this tier follows) changes
        nothing here: a file's space is freed either way. Lock NOT held; thread-safe."""
        pending = Pending()
        freed = 0
        with self._lock:
            while freed < nbytes and (victim := self._evict_one(pending)) is not None:
                pending.doomed.append(self._path(victim[0]))
                freed += victim[1]
        self._finish(pending)
        return freed

    def _leave(self, key: bytes) -> None:
        """``key``'s file is being removed by this tier: adopt it nowhere until ``_left``."""
        self._leaving[key] += 1
        if key in self._readers:
            self._dropped_reads.add(key)

    def _left(self, keys: list[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._leaving[key] -= 1
                if self._leaving[key] <= 0:
                    del self._leaving[key]

    def _begin_read(self, key: bytes) -> None:
        """Lock NOT held: a read of ``key``'s file starts (its file is not reused meanwhile)."""
        with self._lock:
            self._readers[key] = self._readers.get(key, 0) + 1
            if key in self._leaving:  # its removal started before this read could see it
                self._dropped_reads.add(key)

    def _end_read(self, key: bytes) -> bool:
        """Lock NOT held: the read ended; True when the key was dropped here during it."""
        with self._lock:
            left = self._readers.pop(key) - 1
            dropped = key in self._dropped_reads
            if left:
                self._readers[key] = left
            else:
                self._dropped_reads.discard(key)
            return dropped

    def _adoptable(self, key: bytes) -> bool:
        return key not in self._leaving

    def _forget(self, key: bytes) -> bool:
        """Take ``key`` out of the index (not its file); True if it was there."""
        if key in self._readers:
            self._dropped_reads.add(key)
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        self.policy.remove(key)
        return True

    def _adopt(self, key: bytes, size: int, p: Pending, depth: int = 0, parent: bytes = b"") -> None:
        """Index a file another writer made, within this tier's capacity; ``depth``/``parent``
        from its lineage record (lineage.py), as that writer's put gave them."""
        if key in self._index or self._make_room(size, p) is None:
            return
        self._index[key] = size
        self._used += size
        self.policy.insert(key, size, depth, parent)

    def _finish(self, p: Pending) -> None:
        """Lock released: unlink what was evicted, then tell the evict listener."""
        for path in p.doomed:
            io.unlink(path)
        if p.left:
            self._left(p.left)
        listener = self.evict_listener
        if listener is not None:
            for key, value in p.evicted:
                listener(key, value)

    # --- the index side of the contract -------------------------------------------------------
    def _entries(self) -> int:
        return len(self._index)

    def _size_of(self, key: bytes) -> int:
        return self._index.get(key, 0)

    def check(self, idle: bool = False) -> list[str]:
        """The invariants; ``idle``: no operation is in flight and no other process shares the
        directory, so every indexed key must have its file, of the indexed size."""
        with self._lock:
            problems: list[str] = []
            if idle:
                problems += self._check_files()
            used = sum(self._index.values())
            if used != self._used:
                problems.append(f"used_bytes {self._used} != sum of file sizes {used}")
            if self._used > self.capacity_bytes:
                problems.append(f"used_bytes {self._used} > capacity {self.capacity_bytes}")
            if self._reserved < 0:
                problems.append(f"negative reservation {self._reserved}")
            if len(self.policy) != len(self._index) or any(k not in self.policy for k in self._index):
                problems.append(f"policy tracks {len(self.policy)} keys, tier holds {len(self._index)}")
            return problems

    def _check_files(self) -> list[str]:
        problems = [f"{n} key(s) still marked leaving or dropped with nothing in flight"
                    for n in [len(self._leaving) + len(self._dropped_reads)] if n]
        for key, size in self._index.items():
            try:
                on_disk = os.stat(self._path(key)).st_size
            except FileNotFoundError:
                problems.append(f"indexed {key.hex()[:16]} has no file")
                continue
            if on_disk != size:
                problems.append(f"indexed {key.hex()[:16]} as {size} bytes, its file has {on_disk}")
        return problems

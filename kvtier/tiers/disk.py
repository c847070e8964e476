"""Local-SSD tier: one file per chunk, O_DIRECT where the platform has it, bounded bytes.

Why one file per chunk rather than segment logs: an atomic ``os.replace`` of a finished temp
file gives crash safety with no recovery code (a ``kill -9`` at any moment leaves either no
file or a whole one); eviction needs no compaction; several processes share a directory
through the file system's own namespace. Its costs are a create + rename per chunk (tens of
microseconds against milliseconds of I/O for a 1-4 MiB chunk) and an unlink per eviction,
which on a ``discard`` mount (as here) costs as much as writing the file: so a put that must
evict renames the victim's file to its temp name and overwrites those blocks in place. Files
are not fsynced: a kill cannot tear them, and a file torn by a power loss fails its checksums.

Layout: ``<path>/<2 hex>/<64 hex key>.kvc`` holds an encoded chunk (``kvtier.chunk``),
zero-padded to 4096 bytes under O_DIRECT (the header carries the true length). Temp files are
``.<hex>.<pid>.<seq>.tmp`` beside it. Start-up rebuilds the index from the headers (oldest file
evicted first), deletes files whose header is bad or disagrees with their length, and removes
temp files of dead writers (``rebuild_stats``). Every read checks header, key and payload
checksum (``decode_chunk(verify=True)``'s checks, without decompressing); a corrupt or
truncated file is a ``Miss("corrupt")`` and is deleted, never served.

Sharing a directory: processes (or tier objects) may open the same directory. Each keeps its
own index and bounds its own view to ``capacity_bytes`` (so the shared footprint is at most
the sum of the writers' capacities). A key this index lacks is looked for on disk before it is
called a miss, and adopted when found, so a reader sees a writer's new chunks without a
restart; a file a sharer evicted reads as a miss. A read that races a sharer's reuse of the
file's blocks fails its checksum: a ``corrupt`` miss, never wrong bytes.

Threads: index, policy and byte counts change under the TierBase lock; reads, writes and
unlinks run outside it (a rename into place racing an eviction of the same key can at worst
lose that chunk: a later miss). A file being read by this process is never reused.
Failure: I/O errors become ``Miss``/``False`` with a log line; ENOSPC evicts and retries once;
a directory that cannot be created or written raises
:class:`~kvtier.errors.TierUnavailableError` at construction.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.chunk import HEADER_SIZE
from kvtier.config import DiskTierConfig
from kvtier.errors import ChunkError, TierUnavailableError
from kvtier.keys import KEY_BYTES
from kvtier.policy import NothingToEvict, make_policy
from kvtier.tiers import disk_io as io
from kvtier.tiers.base import (
    CORRUPT,
    ERROR,
    EVICTED,
    Entry,
    Miss,
    Probe,
    TierBase,
    TierUsage,
    check_keys,
)
from kvtier.tiers.disk_io import ALIGN, align_up

__all__ = ["ALIGN", "DiskTier", "RebuildStats", "align_up"]

log = logging.getLogger(__name__)

SUFFIX = ".kvc"
_NOSPACE = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class RebuildStats:
    """What start-up found: chunk files indexed, their bytes, bad files deleted, temp
    leftovers removed, chunks evicted to get under capacity, and how long it took."""

    files: int
    bytes: int
    bad: int
    tmp_removed: int
    evicted: int
    seconds: float


class _Pending:
    """Work decided under the lock and done after it: files to unlink (an unlink can take
    milliseconds on a ``discard`` mount) and evicted chunks for the listener."""

    __slots__ = ("doomed", "evicted")

    def __init__(self) -> None:
        self.doomed: list[str] = []
        self.evicted: list[tuple[bytes, bytes]] = []


class DiskTier(TierBase):
    """See the module docstring for layout, crash safety, sharing and threads."""

    def __init__(self, config: DiskTierConfig | None = None, name: str = "disk") -> None:
        super().__init__()
        config = config or DiskTierConfig()
        self.name = name
        self.config = config
        self.capacity_bytes = config.capacity_bytes
        self.root = os.path.abspath(os.path.expanduser(config.path))
        self.policy = make_policy(config.policy)
        self._index: dict[bytes, int] = {}  # key -> size of its file on disk
        self._readers: dict[bytes, int] = {}  # key -> reads in flight (its file is not reused)
        self._used = 0
        self._reserved = 0  # bytes promised to puts whose files are being written
        self._seq = itertools.count()
        self._scratch = io.Scratch()
        self.dropped_puts = 0
        self.corrupt_reads = 0
        try:
            for i in range(256):
                os.makedirs(os.path.join(self.root, f"{i:02x}"), exist_ok=True)
        except OSError as exc:
            raise TierUnavailableError(f"disk tier directory {self.root} cannot be created: "
                                       f"{exc.strerror or exc}") from exc
        self.direct = self._probe_medium(bool(config.o_direct and io.O_DIRECT))
        self.rebuild_stats = self._rebuild()

    # --- start-up -----------------------------------------------------------------------------
    def _probe_medium(self, direct: bool) -> bool:
        """Write and remove a probe file: proves the directory writable, and whether O_DIRECT
        works here (EINVAL means the file system refuses it: fall back to buffered I/O)."""
        probe = os.path.join(self.root, f".probe.{os.getpid()}.{next(self._seq)}.tmp")
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (io.O_DIRECT if direct else 0), 0o644)
            try:
                os.write(fd, self._scratch.get(ALIGN)[:ALIGN])
            finally:
                os.close(fd)
                os.unlink(probe)
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                log.info("disk tier %s: O_DIRECT not supported here, using buffered I/O", self.root)
                return self._probe_medium(False)
            raise TierUnavailableError(f"disk tier directory {self.root} is not writable: "
                                       f"{exc.strerror or exc}") from exc
        return direct

    def _rebuild(self) -> RebuildStats:
        start = time.monotonic()
        found: list[tuple[int, bytes, int]] = []
        bad: list[str] = []
        tmp: list[str] = []
        for shard in os.scandir(self.root):
            is_shard = len(shard.name) == 2 and shard.is_dir(follow_symlinks=False)
            for f in os.scandir(shard.path) if is_shard else [shard]:
                if f.name.endswith(".tmp"):
                    if io.stale_tmp(f):
                        tmp.append(f.path)
                    continue
                if (f is shard or not f.name.endswith(SUFFIX) or not f.name.startswith(shard.name)
                        or len(f.name) != 2 * KEY_BYTES + len(SUFFIX)):
                    continue  # not ours: leave it alone
                try:
                    key = bytes.fromhex(f.name[: 2 * KEY_BYTES])
                    st = f.stat()
                    with open(f.path, "rb") as fh:
                        io.check_header(fh.read(HEADER_SIZE), key, st.st_size)
                    found.append((st.st_mtime_ns, key, st.st_size))
                except (ValueError, OSError):  # ChunkError is a ValueError
                    bad.append(f.path)
        tmp_removed = sum(io.unlink(path) for path in tmp)
        for path in bad:
            io.unlink(path)
        if bad:
            log.warning("disk tier %s: deleted %d chunk files with a bad header or length", self.root, len(bad))
        pending = _Pending()
        with self._lock:
            for _, key, size in sorted(found):
                self._index[key] = size
                self._used += size
                self.policy.insert(key, size)
            while self._used > self.capacity_bytes and (victim := self._evict_one(pending)):
                pending.doomed.append(self._path(victim[0]))
        self._finish(pending)
        return RebuildStats(len(found), self._used, len(bad), tmp_removed, len(pending.doomed),
                            time.monotonic() - start)

    # --- bookkeeping (lock held unless said otherwise) ---------------------------------------
    def _path(self, key: bytes) -> str:
        h = key.hex()
        return f"{self.root}/{h[:2]}/{h}{SUFFIX}"

    def _evict_one(self, p: _Pending) -> tuple[bytes, int] | None:
        """Take the policy's victim out of the index: (key, file size), or None when nothing
        can be evicted. The caller decides the file's fate (unlink or reuse)."""
        try:
            victim = self.policy.evict()
        except NothingToEvict:
            return None
        if self.evict_listener is not None:
            value = self._read(victim, None, adopt=False)
            if isinstance(value, memoryview):
                p.evicted.append((victim, bytes(value)))
        size = self._index.pop(victim, 0)  # 0: the listener's read found it corrupt
        self._used -= size
        self._remember_evicted(victim)
        return victim, size

    def _make_room(self, size: int, p: _Pending, reuse_as: str | None = None) -> int | None:
        """Evict until ``size`` more bytes fit. With ``reuse_as``, the first victim's file is
        renamed there for the caller to overwrite (no unlink, no block allocation). Returns
        that file's size (0 if none), or None when no room can be made."""
        reused = 0
        if size > self.capacity_bytes:
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

    def _forget(self, key: bytes) -> bool:
        """Take ``key`` out of the index (not its file); True if it was there."""
        size = self._index.pop(key, None)
        if size is None:
            return False
        self._used -= size
        self.policy.remove(key)
        return True

    def _adopt(self, key: bytes, size: int, p: _Pending) -> None:
        """Index a file another writer made, within this tier's capacity."""
        if key in self._index or self._make_room(size, p) is None:
            return
        self._index[key] = size
        self._used += size
        self.policy.insert(key, size)

    def _finish(self, p: _Pending) -> None:
        """Lock released: unlink what was evicted, then tell the evict listener."""
        for path in p.doomed:
            io.unlink(path)
        listener = self.evict_listener
        if listener is not None:
            for key, value in p.evicted:
                listener(key, value)

    # --- reads --------------------------------------------------------------------------------
    def _read(self, key: bytes, out: memoryview | None, adopt: bool = True) -> memoryview | Miss:
        """Read and verify ``key``'s chunk; into ``out`` when given (then the result is a view
        of ``out``) or else into this thread's scratch buffer (valid until its next use)."""
        path = self._path(key)
        with self._lock:
            self._readers[key] = self._readers.get(key, 0) + 1
        try:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | (io.O_DIRECT if self.direct else 0))
            except FileNotFoundError:
                with self._lock:
                    return Miss(EVICTED) if self._forget(key) else self._absent(key)  # a sharer evicted it
            except OSError as exc:
                log.warning("disk tier: cannot open %s: %s", path, exc)
                return Miss(ERROR)
            try:
                view, size = io.read_file(fd, out, self._scratch, self.direct)
                io.verify(view, key, size)
            except (ChunkError, OSError) as exc:
                log.warning("disk tier: dropping %s: %s", path, exc)
                with self._lock:
                    self.corrupt_reads += 1
                    self._forget(key)
                io.unlink(path)
                return Miss(CORRUPT)
            finally:
                os.close(fd)
        finally:
            with self._lock:
                left = self._readers.pop(key) - 1
                if left:
                    self._readers[key] = left
        pending = _Pending()
        with self._lock:
            if key in self._index:
                self.policy.access(key)
            elif adopt and not self._closed:
                self._adopt(key, size, pending)
        self._finish(pending)
        return view

    def _probe(self, keys: Sequence[bytes]) -> Probe:
        with self._lock:
            index = self._index
            hits = 0
            for key in keys:
                if key not in index:
                    break
                hits += 1
            if hits == len(keys):
                return Probe(hits)
        # Not in this index: another process sharing the directory may have written it.
        pending = _Pending()
        try:
            for key in keys[hits:]:
                with self._lock:
                    if key in self._index:
                        hits += 1
                        continue
                try:
                    size = os.stat(self._path(key)).st_size
                except OSError:
                    with self._lock:
                        return Probe(hits, self._absent(key).reason)
                with self._lock:
                    self._adopt(key, size, pending)
                hits += 1
            return Probe(hits)
        finally:
            self._finish(pending)

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        check_keys(keys)
        self._check_open()
        out: list[bytes | Miss] = []
        for key in keys:
            value = self._read(key, None)
            out.append(value if isinstance(value, Miss) else bytes(value))
        return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"get_into got {len(keys)} keys and {len(outs)} buffers")
        self._check_open()
        results: list[int | Miss] = []
        for key, out in zip(keys, outs):
            value = self._read(key, out)
            if isinstance(value, Miss):
                results.append(value)
                continue
            n = value.nbytes
            if n > out.nbytes:
                raise ValueError(f"buffer of {out.nbytes} bytes is too small for a {n}-byte chunk")
            if value.obj is not out.obj:  # read into scratch, not straight into ``out``
                out[:n] = value
            results.append(n)
        return results

    # --- writes -------------------------------------------------------------------------------
    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        self._check_open()
        return [self._put_one(e) for e in entries]

    def _put_one(self, e: Entry) -> bool:
        data = memoryview(e.data).cast("B")
        try:
            n = io.check_header(data[:HEADER_SIZE], e.key, data.nbytes).nbytes
        except ChunkError as exc:
            log.debug("disk tier: refusing a put that is not a whole chunk of its key: %s", exc)
            return False
        size = align_up(n) if self.direct else n
        path = self._path(e.key)
        tmp = f"{path[: -len(SUFFIX) - 2 * KEY_BYTES]}.{e.key.hex()}.{os.getpid()}.{next(self._seq)}.tmp"
        pending = _Pending()
        with self._lock:
            self._check_open()
            reused = self._make_room(size, pending, tmp)
            if reused is not None:
                self._reserved += size
        self._finish(pending)
        if reused is None:
            self.dropped_puts += 1
            return False
        try:
            err = self._write_file(data[:n], size, tmp, path, reused)
            if err in _NOSPACE:  # the file system is fuller than our own count says
                pending = _Pending()
                with self._lock:
                    freed = 0
                    while freed < size and (victim := self._evict_one(pending)) is not None:
                        pending.doomed.append(self._path(victim[0]))
                        freed += victim[1]
                self._finish(pending)
                err = self._write_file(data[:n], size, tmp, path, 0)
        finally:
            with self._lock:
                self._reserved -= size
        with self._lock:
            if err:
                self.dropped_puts += 1
                return False
            self._used += size - self._index.get(e.key, 0)
            self._index[e.key] = size
            self._forget_evicted(e.key)
            self.policy.insert(e.key, size, e.depth, e.parent)
        return True

    def _write_file(self, data: memoryview, size: int, tmp: str, path: str, reused: int) -> int:
        """Write ``data`` (padded to ``size``) to ``tmp`` (an existing file of ``reused``
        bytes when non-zero) and rename it to ``path``. Returns 0, or the errno that stopped
        it (``tmp`` is removed then)."""
        for attempt in range(2):
            direct = self.direct
            create = 0 if reused else os.O_CREAT | os.O_EXCL
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC | create | (io.O_DIRECT if direct else 0), 0o644)
                try:
                    if direct:
                        io.write_direct(fd, data, size, self._scratch)
                    else:
                        io.pwrite_full(fd, data)
                    if reused > size:
                        os.ftruncate(fd, size)
                finally:
                    os.close(fd)
                os.replace(tmp, path)
                return 0
            except OSError as exc:
                io.unlink(tmp)
                reused = 0
                if attempt == 0 and exc.errno == errno.ENOENT:  # shard dir removed under us
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    continue
                if attempt == 0 and direct and exc.errno == errno.EINVAL:
                    log.info("disk tier %s: O_DIRECT write refused, using buffered I/O", self.root)
                    self.direct = False
                    continue
                if exc.errno not in _NOSPACE:
                    log.warning("disk tier: writing %s failed: %s", path, exc)
                return exc.errno or errno.EIO
        return errno.EIO

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            self._check_open()
            known = [self._forget(key) for key in keys]
        # Unlink outside the lock; a file only a sharer indexed counts as deleted too.
        return sum(io.unlink(self._path(k)) or was for k, was in zip(keys, known))

    # --- the rest of the contract -------------------------------------------------------------
    def pin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self.policy.pin(key)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self.policy.unpin(key)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.name, self._used, self.capacity_bytes, len(self._index))

    def check(self) -> list[str]:
        with self._lock:
            problems: list[str] = []
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

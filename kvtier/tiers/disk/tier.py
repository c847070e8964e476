"""Local-SSD tier: one file per chunk, O_DIRECT where the platform has it, bounded bytes.

Why one file per chunk rather than segment logs: an atomic ``os.replace`` of a finished temp
file gives crash safety with no recovery code (a ``kill -9`` at any moment leaves either no
file or a whole one); eviction needs no compaction; several processes share a directory
through the file system's own namespace. Its costs are a create + rename per chunk (tens of
microseconds against milliseconds of I/O for a 1-4 MiB chunk) and an unlink per eviction,
which on a ``discard`` mount (as here) costs as much as writing the file: so a put that must
evict renames the victim's file to its temp name and overwrites those blocks in place. Files
are not fsynced: a kill cannot tear them, and a file torn by a power loss fails its checksums.

This module holds the read and write paths. Its pieces: ``layout`` (file names, the
start-up scan, the atomic publish of a file), ``index`` (index, byte accounting,
eviction; the base class), ``direct_io`` (O_DIRECT, aligned buffers, checks). Start-up rebuilds
the index from the chunk headers (``rebuild_stats``), each chunk with the depth and parent its
put gave (``lineage``: kept with the file, so leaf-first policies stay leaf-first; an adopted
sharer's file too). Every read checks header, key and
payload checksum (``decode_chunk(verify=True)``'s checks, without decompressing); a corrupt or
truncated file is a ``Miss("corrupt")`` and is deleted, never served.

Sharing a directory: processes (or tier objects) may open the same directory. Each keeps its
own index and bounds its own view to ``capacity_bytes`` (so the shared footprint is at most
the sum of the writers' capacities). A key this index lacks is looked for on disk before it is
called a miss, and adopted when found, so a reader sees a writer's new chunks without a
restart; a file a sharer evicted reads as a miss. A read that races a sharer's reuse of the
file's blocks fails its checksum: a ``corrupt`` miss, never wrong bytes.

Parallel reads: ``get_into`` a batch of several keys whose buffers take the bytes directly
(page-aligned under O_DIRECT: no scratch buffer in the reading thread) reads ``read_threads``
files at a time on the process's shared reader pool (``readers``: why, and its bounds);
results keep key order. ``get`` (the allocating path) reads one file after another.

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
from collections.abc import Sequence

from kvtier.chunk import HEADER_SIZE
from kvtier.config import DiskTierConfig
from kvtier.errors import ChunkError
from kvtier.tiers.base import CORRUPT, ERROR, EVICTED, Entry, Miss, Probe, check_keys, leading_run
from kvtier.tiers.disk import direct_io as io
from kvtier.tiers.disk import lineage
from kvtier.tiers.disk.direct_io import ALIGN, align_up
from kvtier.tiers.disk.index import DiskIndex, Pending
from kvtier.tiers.disk.layout import (
    NOSPACE,
    NotRegular,
    RebuildStats,
    make_shards,
    open_regular,
    probe_medium,
    read_head,
    tmp_path,
    write_file,
)
from kvtier.tiers.disk.readers import read_all, start_pool

__all__ = ["ALIGN", "DiskTier", "RebuildStats", "align_up"]

log = logging.getLogger(__name__)


class DiskTier(DiskIndex):
    """See the module docstring for layout, crash safety, sharing and threads."""

    def __init__(self, config: DiskTierConfig | None = None, name: str = "disk") -> None:
        config = config or DiskTierConfig()
        super().__init__(os.path.abspath(os.path.expanduser(config.path)), config.capacity_bytes,
                         config.policy)
        self.name = name
        self.config = config
        self._seq = itertools.count()
        self._scratch = io.Scratch()
        self._victim_scratch = io.Scratch()  # the evict listener's reads (see _read)
        if config.read_threads > 1:
            start_pool()  # its threads start on this thread's CPUs (readers.py says why)
        self.dropped_puts = 0
        self.corrupt_reads = 0
        make_shards(self.root)
        self.direct = probe_medium(self.root, bool(config.o_direct and io.O_DIRECT), self._scratch, self._seq)
        self.rebuild_stats = self._rebuild()

    # --- reads --------------------------------------------------------------------------------
    def _read(self, key: bytes, out: memoryview | None, victim: bool = False) -> memoryview | Miss:
        """Read and verify ``key``'s chunk; into ``out`` when given (then the result is a view
        of ``out``) or else into this thread's scratch buffer (valid until its next use).
        ``victim``: the evict listener's read of a chunk being evicted (index.py), which can
        happen in the middle of another read of this thread (adopting a sharer's file makes
        room): it goes through a second scratch buffer, so the first read's bytes stay, and
        is never adopted."""
        path = self._path(key)
        self._begin_read(key)
        try:
            try:
                fd = open_regular(path, os.O_RDONLY | (io.O_DIRECT if self.direct else 0))
            except FileNotFoundError:
                with self._lock:
                    return Miss(EVICTED) if self._forget(key) else self._absent(key)  # a sharer evicted it
            except NotRegular as exc:  # a planted symlink/FIFO/directory: never followed
                log.warning("disk tier: %s", exc)
                with self._lock:
                    self._forget(key)
                return Miss(CORRUPT)
            except OSError as exc:
                log.warning("disk tier: cannot open %s: %s", path, exc)
                return Miss(ERROR)
            try:
                view, size = io.read_file(fd, out, self._victim_scratch if victim else self._scratch,
                                          self.direct)
                io.verify(view, key, size)
                # Not indexed: adopted below if it may be, with the parent its put was given.
                link = (lineage.NONE if victim or key in self._index
                        else lineage.parse(lineage.fetch(fd), key, path))
            except (ChunkError, OSError) as exc:
                log.warning("disk tier: dropping %s: %s", path, exc)
                with self._lock:
                    self.corrupt_reads += 1
                    self._forget(key)
                # Only the file read: a sharer may have published a good one at the path since.
                io.unlink_if_same(path, fd)
                return Miss(CORRUPT)
            finally:
                os.close(fd)
        finally:
            dropped = self._end_read(key)
        pending = Pending()
        with self._lock:
            if key in self._index:
                self.policy.access(key)
            elif not victim and not self._closed and not dropped and self._adoptable(key):
                self._adopt(key, size, pending, *link)
        self._finish(pending)
        return view

    def _probe(self, keys: Sequence[bytes]) -> Probe:
        with self._lock:
            hits = leading_run(self._index, keys)
            if hits == len(keys):
                return Probe(hits)
        # Not in this index: another process sharing the directory may have written it.
        pending = Pending()
        try:
            for key in keys[hits:]:
                with self._lock:
                    if key in self._index:
                        hits += 1
                        continue
                self._begin_read(key)
                try:  # a regular file holding this key's chunk header, nothing less
                    head, size, record = read_head(self._path(key))
                    io.check_header(head, key, size)
                except (OSError, ChunkError):
                    with self._lock:
                        return Probe(hits, self._absent(key).reason)
                finally:
                    dropped = self._end_read(key)
                link = lineage.parse(record, key, self._path(key))  # the parent its put was given
                with self._lock:
                    if dropped or not self._adoptable(key):  # this tier is removing that file
                        return Probe(hits, self._absent(key).reason)
                    self._adopt(key, size, pending, *link)
                hits += 1
            return Probe(hits)
        finally:
            self._finish(pending)

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        """One read after another: each lands in this thread's scratch buffer before its bytes
        are copied out (pool threads would each keep a scratch as large as their largest chunk)."""
        check_keys(keys)
        self._check_open()
        out: list[bytes | Miss] = []
        for key in keys:
            value = self._read(key, None)
            out.append(value if isinstance(value, Miss) else bytes(value))
        return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        """Several files at a time (``read_threads``) when every buffer can take its file's
        bytes directly (page-aligned under O_DIRECT), else one after another."""
        check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"get_into got {len(keys)} keys and {len(outs)} buffers")
        self._check_open()

        def read(i: int) -> int | Miss:
            key, out = keys[i], outs[i]
            value = self._read(key, out)
            if isinstance(value, Miss):
                return value
            n = value.nbytes
            if n > out.nbytes:
                raise ValueError(f"buffer of {out.nbytes} bytes is too small for a {n}-byte chunk")
            if value.obj is not out.obj:  # read into scratch, not straight into ``out``
                out[:n] = value
            return n

        direct = not self.direct or all(io.address(out) % ALIGN == 0 for out in outs)
        return read_all(read, range(len(keys)), self.config.read_threads if direct else 1)

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
        record = lineage.encode(e.key, e.depth, e.parent)  # kept with the file (lineage.py)
        path = self._path(e.key)
        tmp = tmp_path(path, e.key, next(self._seq))
        pending = Pending()
        with self._lock:
            self._check_open()
            # An overwrite frees the old file's bytes itself: room only for the difference
            # (else a full tier evicts an unrelated chunk, or refuses a pinned key's overwrite).
            old = self._index.get(e.key, 0)
            reused = self._make_room(size - old, pending, tmp)
            if reused is not None and old and e.key not in self._index:
                # The key itself was a victim: its bytes are gone, so they no longer make room.
                if self._make_room(size, pending) is None:
                    if reused:
                        pending.doomed.append(tmp)  # the victim's file renamed for reuse
                    reused = None
            if reused is not None:
                self._reserved += size
        if reused is None:
            self._finish(pending)
            self.dropped_puts += 1
            return False
        err = errno.EIO
        try:  # the reservation is given back however this ends (an evict listener may raise)
            self._finish(pending)
            err = self._write_file(data[:n], size, tmp, path, reused, record)
            if err in NOSPACE:  # the file system is fuller than our own count says
                self._free_for_nospace(size)
                err = self._write_file(data[:n], size, tmp, path, 0, record)
        finally:
            with self._lock:
                self._reserved -= size
            if err and reused:
                io.unlink(tmp)  # a victim's file renamed for reuse and never written
        with self._lock:
            if err:
                self.dropped_puts += 1
                return False
            self._used += size - self._index.get(e.key, 0)
            self._index[e.key] = size
            self._forget_evicted(e.key)
            self.policy.insert(e.key, size, e.depth, e.parent)
        return True

    def _write_file(self, data: memoryview, size: int, tmp: str, path: str, reused: int, record: bytes) -> int:
        """:func:`layout.write_file` with this tier's medium; 0 or the errno. A refusal
        of O_DIRECT turns it off for this tier's later I/O."""
        err, direct = write_file(data, size, tmp, path, reused, self.direct, self._scratch, self.root, record)
        if not direct:
            self.direct = False
        return err

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            self._check_open()
            known = [self._forget(key) for key in keys]
            for key in keys:
                self._leave(key)
        try:  # unlink outside the lock; a file only a sharer indexed counts as deleted too
            return sum(io.unlink(self._path(k)) or was for k, was in zip(keys, known))
        finally:
            self._left(list(keys))

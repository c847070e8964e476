"""The disk tier's directory: chunk-file names, the start-up scan, the medium probe, and the
atomic publish of one chunk file.

Layout: ``<root>/<2 hex>/<64 hex key>.kvc`` holds an encoded chunk (``kvtier.chunk``),
zero-padded to 4096 bytes under O_DIRECT (the header carries the true length), and in an
extended attribute the chunk's depth and parent key (``lineage``; older files have none).
Temp files are ``.<hex>.<pid>.<seq>.tmp`` beside it. A chunk file appears only by ``os.replace`` of a finished
temp file, so a ``kill -9`` at any moment leaves either no file or a whole one. Start-up
(:func:`scan`) finds the chunk files by their headers, deletes files of ours (kvtier chunk
magic) whose header is bad or disagrees with their length, and removes temp files of dead
writers; anything else with a chunk-like name (a file of someone else's, a directory, a FIFO,
a symlink) is left alone, logged, and never opened in a way that could block or follow it.

Private and link-proof: directories are made 0700 and files 0600 (KV is user data; the umask
can only narrow that); every open of a chunk or temp file uses ``O_NOFOLLOW`` and checks it
is a regular file, so a symlink planted in the tier directory is never followed, for reading
or for writing (:func:`open_regular`).

Everything here is stateless and knows nothing of the tier's index, capacity or lock: the
tier (``kvtier.tiers.disk``) decides what to write, evict and keep. Failure: directory
problems at start-up raise :class:`~kvtier.errors.TierUnavailableError`; a failed write is an
errno returned to the caller; other ``OSError``s of the medium are the caller's.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.chunk import HEADER_SIZE, MAGIC
from kvtier.errors import TierUnavailableError
from kvtier.keys import KEY_BYTES
from kvtier.tiers.disk import direct_io as io
from kvtier.tiers.disk import lineage
from kvtier.tiers.disk.direct_io import ALIGN

__all__ = ["NOSPACE", "SUFFIX", "Found", "RebuildStats", "chunk_path", "make_private_dir", "make_shards",
           "open_regular", "probe_medium", "read_head", "scan", "tmp_path", "write_file"]

# The tier's logger: these lines are the disk tier's, whichever module emits them.
log = logging.getLogger("kvtier.tiers.disk")

SUFFIX = ".kvc"
NOSPACE = (errno.ENOSPC, errno.EDQUOT)
DIR_MODE = 0o700
FILE_MODE = 0o600
NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class NotRegular(OSError):
    """A chunk-named path that is not a regular file (symlink, directory, FIFO, device)."""


def open_regular(path: str, flags: int = os.O_RDONLY) -> int:
    """Open ``path`` without following a final symlink and without blocking on a FIFO;
    raises :class:`NotRegular` unless it is a regular file (FileNotFoundError etc. as is)."""
    try:
        fd = os.open(path, flags | NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise NotRegular(exc.errno, f"{path} is not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(errno.EINVAL, f"{path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_head(path: str) -> tuple[bytes, int, bytes | None]:
    """The first HEADER_SIZE bytes of a regular file, its size and its raw lineage record
    (:func:`lineage.fetch`; see :func:`open_regular`). A file others may read (made by an
    older version) is narrowed to 0600 on the way."""
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_mode & 0o077:
            try:
                os.fchmod(fd, FILE_MODE)
            except PermissionError:  # not ours to change: the caller's checks still apply
                pass
        return os.pread(fd, HEADER_SIZE, 0), st.st_size, lineage.fetch(fd)
    finally:
        os.close(fd)


def make_private_dir(path: str) -> None:
    """``path`` and its missing parents, each created 0700 (an existing ``path`` is narrowed
    to 0700 too: it is this tier's). Raises OSError, or NotADirectoryError for a symlink."""
    missing = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        head = os.path.dirname(head)
    for part in reversed(missing):
        try:
            os.mkdir(part, DIR_MODE)
        except FileExistsError:
            pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, f"{path} is not a directory (a symlink?)")
    if stat.S_IMODE(st.st_mode) != DIR_MODE:
        os.chmod(path, DIR_MODE)


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


def chunk_path(root: str, key: bytes) -> str:
    h = key.hex()
    return f"{root}/{h[:2]}/{h}{SUFFIX}"


def tmp_path(path: str, key: bytes, seq: int) -> str:
    """A temp name beside ``path`` (the chunk file of ``key``), unique per process and ``seq``
    (direct_io.stale_tmp reads the pid and token back)."""
    return f"{path[: -len(SUFFIX) - 2 * KEY_BYTES]}.{key.hex()}.{os.getpid()}-{io.WRITER_TOKEN}.{seq}.tmp"


def make_shards(root: str) -> None:
    """Create ``root`` and its 256 shard directories, private (existing ones are fine, and
    narrowed to 0700); a shard that is a symlink or a file is refused."""
    try:
        make_private_dir(root)
        for i in range(256):
            make_private_dir(os.path.join(root, f"{i:02x}"))
    except OSError as exc:
        raise TierUnavailableError(f"disk tier directory {root} cannot be created: "
                                   f"{exc.strerror or exc}") from exc


def probe_medium(root: str, direct: bool, scratch: io.Scratch, seq: Iterator[int]) -> bool:
    """Write and remove a probe file: proves the directory writable, and whether O_DIRECT
    works here (EINVAL means the file system refuses it: fall back to buffered I/O). Returns
    whether O_DIRECT is to be used."""
    probe = os.path.join(root, f".probe.{os.getpid()}-{io.WRITER_TOKEN}.{next(seq)}.tmp")  # as tmp_path
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | (io.O_DIRECT if direct else 0),
                     FILE_MODE)
        try:
            os.write(fd, scratch.get(ALIGN)[:ALIGN])
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            log.info("disk tier %s: O_DIRECT not supported here, using buffered I/O", root)
            return probe_medium(root, False, scratch, seq)
        raise TierUnavailableError(f"disk tier directory {root} is not writable: "
                                   f"{exc.strerror or exc}") from exc
    return direct


class Found(NamedTuple):
    """A chunk file the start-up scan found; ``depth``/``parent`` from its lineage record
    (0, b"": none). Sorted as a tuple: oldest first, and among files of one file time
    (coarse: a few ms) a prefix before the chunks that extend it, as they were put."""

    mtime_ns: int
    depth: int
    key: bytes
    size: int
    parent: bytes


def scan(root: str) -> tuple[list[Found], int, int]:
    """Find the chunk files under ``root``: ``(files, bad, tmp_removed)`` where ``files`` are
    sorted oldest first. Our files (chunk magic) with a bad header or length and stale temp
    files are deleted here; names that are not ours, and entries that are not regular files,
    are left alone (logged). A bad lineage record only costs its chunk the parent (logged)."""
    found: list[Found] = []
    bad: list[str] = []
    tmp: list[str] = []
    strangers = 0
    bad_records: list[str] = []
    for shard in os.scandir(root):
        is_shard = len(shard.name) == 2 and shard.is_dir(follow_symlinks=False)
        for f in os.scandir(shard.path) if is_shard else [shard]:
            if f.name.endswith(".tmp"):
                if f.is_file(follow_symlinks=False) and io.stale_tmp(f):
                    tmp.append(f.path)
                continue
            if (f is shard or not f.name.endswith(SUFFIX) or not f.name.startswith(shard.name)
                    or len(f.name) != 2 * KEY_BYTES + len(SUFFIX)):
                continue  # not ours: leave it alone
            try:
                key = bytes.fromhex(f.name[: 2 * KEY_BYTES])
                head, size, record = read_head(f.path)
            except (ValueError, OSError):  # not hex, not a regular file, unreadable
                strangers += 1
                continue
            try:
                io.check_header(head, key, size)
                mtime = f.stat(follow_symlinks=False).st_mtime_ns
            except (ValueError, OSError):  # ChunkError is a ValueError
                if head[: len(MAGIC)] == MAGIC:
                    bad.append(f.path)  # ours, damaged (torn by a crash, bit rot)
                else:
                    strangers += 1
                continue
            depth, parent = lineage.NONE
            if record is not None:
                try:
                    depth, parent = lineage.decode(record, key)
                except lineage.BadLineage as exc:
                    bad_records.append(f"{f.path}: {exc}")
            found.append(Found(mtime, depth, key, size, parent))
    tmp_removed = sum(io.unlink(path) for path in tmp)
    for path in bad:
        io.unlink(path)
    if bad:
        log.warning("disk tier %s: deleted %d chunk files with a bad header or length", root, len(bad))
    if strangers:
        log.warning("disk tier %s: left alone %d entries with chunk names that are not kvtier chunk "
                    "files (not regular files, or no chunk magic)", root, strangers)
    if bad_records:
        log.warning("disk tier %s: ignored %d bad lineage records (those chunks are indexed with no "
                    "parent), e.g. %s", root, len(bad_records), bad_records[0])
    return sorted(found), len(bad), tmp_removed


def write_file(data: memoryview, size: int, tmp: str, path: str, reused: int, direct: bool,
               scratch: io.Scratch, root: str, record: bytes = b"") -> tuple[int, bool]:
    """Write ``data`` (padded to ``size``) to ``tmp`` (an existing file of ``reused`` bytes
    when non-zero), give it its lineage ``record`` (:func:`lineage.attach`: published by the
    same rename, so the file appears with it or not at all) and rename it to ``path``.
    Returns ``(errno, direct)``: 0 or the errno that stopped it (``tmp`` is removed then), and
    False when O_DIRECT was refused here and the write fell back to buffered I/O (the caller
    stops using O_DIRECT). ENOSPC/EDQUOT are returned without a log line: the caller evicts
    and retries."""
    for attempt in range(2):
        create = 0 if reused else os.O_CREAT | os.O_EXCL
        try:
            # O_NOFOLLOW: a reused victim's file that is really a planted symlink is refused
            # (ELOOP), never written through; created files are 0600.
            fd = os.open(tmp, os.O_WRONLY | NOFOLLOW | create | (io.O_DIRECT if direct else 0), FILE_MODE)
            try:
                if direct:
                    io.write_direct(fd, data, size, scratch)
                else:
                    io.pwrite_full(fd, data)
                if reused > size:
                    os.ftruncate(fd, size)
                lineage.attach(fd, record, bool(reused), root)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return 0, direct
        except OSError as exc:
            io.unlink(tmp)
            reused = 0
            if attempt == 0 and exc.errno == errno.ENOENT:  # shard dir removed under us
                try:
                    make_private_dir(os.path.dirname(path))
                except OSError as mkdir_exc:  # e.g. replaced by a symlink: refused, not followed
                    log.warning("disk tier: writing %s failed: %s", path, mkdir_exc)
                    return mkdir_exc.errno or errno.EIO, direct
                continue
            if attempt == 0 and exc.errno == errno.ELOOP:  # the reused file was a symlink
                continue
            if attempt == 0 and direct and exc.errno == errno.EINVAL:
                log.info("disk tier %s: O_DIRECT write refused, using buffered I/O", root)
                direct = False
                continue
            if exc.errno not in NOSPACE:
                log.warning("disk tier: writing %s failed: %s", path, exc)
            return exc.errno or errno.EIO, direct
    return errno.EIO, direct

"""File primitives of the disk tier: aligned buffers, whole reads/writes, O_DIRECT, checks.

O_DIRECT needs the memory address, the file offset and the length of every transfer aligned
to the device's logical block; 4096 covers every device we meet. Files are zero-padded to
that multiple (chunk headers carry the true length), and sources or destinations that are not
page-aligned go through a per-thread aligned scratch buffer.

Everything here is stateless or thread-local and raises ``OSError`` (medium) or
:class:`~kvtier.errors.ChunkError` (bytes that cannot be trusted); the tier turns both into
misses. The unlinks do not raise: a file that cannot be removed is logged and stays.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time

import numpy as np
import xxhash

from kvtier.chunk import HEADER_SIZE, ChunkHeader, decode_header
from kvtier.errors import ChunkError

log = logging.getLogger(__name__)
ALIGN = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)
TMP_MAX_AGE_S = 600.0  # no write takes this long: older temp files are leftovers
# Beside the pid in temp names: a process restarted under the same pid (a container's PID 1)
# must see its predecessor's temp files as stale, not as its own.
WRITER_TOKEN = os.urandom(4).hex()
_ZEROS = memoryview(bytes(ALIGN))


def align_up(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class Scratch(threading.local):
    """Per-thread page-aligned buffer, grown on demand and pre-touched (no page faults on
    the I/O path). A view it returns is valid until the same thread's next ``get``."""

    def __init__(self) -> None:
        self.map: mmap.mmap | None = None
        self.view = memoryview(b"")

    def get(self, n: int) -> memoryview:
        if len(self.view) < n:
            self.map = mmap.mmap(-1, align_up(max(n, 1 << 20)))
            np.frombuffer(self.map, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
            self.view = memoryview(self.map)
        return self.view


def pread_full(fd: int, view: memoryview, offset: int, want: int) -> None:
    """Read at least ``want`` bytes into ``view`` from ``offset`` (``view`` may be longer:
    O_DIRECT reads whole blocks); a file that ends first holds a truncated chunk."""
    got = 0
    while got < want:  # not beyond: an O_DIRECT read from an unaligned offset is EINVAL
        n = os.preadv(fd, [view[got:]], offset + got)
        if n == 0:
            raise ChunkError("truncated", f"read {got} bytes, expected {want}")
        got += n


def pwrite_full(fd: int, view: memoryview, offset: int = 0) -> None:
    done = 0
    while done < view.nbytes:
        done += os.pwrite(fd, view[done:], offset + done)


def write_direct(fd: int, data: memoryview, size: int, scratch: Scratch) -> None:
    """Write ``data`` zero-padded to ``size`` (a multiple of ALIGN) through O_DIRECT. A
    page-aligned source (a pinned or arena buffer) is written in place but for its last
    partial block; any other source is bounce-copied through ``scratch`` (a memcpy, ~15-20%
    of a put on this machine)."""
    n = data.nbytes
    bulk = n & ~(ALIGN - 1) if address(data) % ALIGN == 0 else 0
    if bulk:
        pwrite_full(fd, data[:bulk])
    buf = scratch.get(size - bulk)
    buf[: n - bulk] = data[bulk:]
    buf[n - bulk : size - bulk] = _ZEROS[: size - n]
    pwrite_full(fd, buf[: size - bulk], bulk)


def read_file(fd: int, out: memoryview | None, scratch: Scratch, direct: bool) -> tuple[memoryview, int]:
    """(the chunk bytes, the file size): a view of ``out`` when the bytes could go there,
    else of ``scratch``. Bytes go straight into ``out`` where the medium allows: all of the
    file with buffered I/O, its aligned prefix under O_DIRECT when ``out`` is page-aligned.
    The view is ``header.nbytes`` long but not yet verified (see :func:`verify`).

    Nothing past the chunk its header declares is read: a file longer than its chunk (a
    foreign or planted one) never grows the scratch buffer beyond that chunk."""
    size = os.fstat(fd).st_size
    if size < HEADER_SIZE:
        raise ChunkError("truncated", f"file has {size} bytes")
    head = 0
    if out is not None and out.nbytes >= ALIGN and (not direct or address(out) % ALIGN == 0):
        head = min(size, out.nbytes) & (~(ALIGN - 1) if direct else -1)
        pread_full(fd, out[:head], 0, head)

    def chunk_of(first: memoryview) -> tuple[int, int]:
        """(n, end): the chunk's length by the header in ``first`` (at most the file), and
        the file offset its read ends at (rounded up to a block under O_DIRECT)."""
        n = min(decode_header(first[:HEADER_SIZE]).nbytes, size)
        return n, (min(size, align_up(n)) if direct else n)

    if out is not None and head == size:
        view, (n, _) = out, chunk_of(out)
    elif out is not None and head:  # the aligned prefix is in ``out``: complete it there
        view, (n, end) = out, chunk_of(out)
        if n > out.nbytes:
            raise ValueError(f"buffer of {out.nbytes} bytes is too small for a {n}-byte chunk")
        if n > head:
            rest = end - head
            buf = scratch.get(align_up(rest))
            pread_full(fd, buf[: align_up(rest) if direct else rest], head, rest)
            out[head:n] = buf[: n - head]
    else:  # into scratch, as much as it holds already; the header says whether more is needed
        view = scratch.get(ALIGN)
        first = min(size, view.nbytes)
        pread_full(fd, view[: align_up(first)] if direct else view[:first], 0, first)
        n, end = chunk_of(view)
        if end > first:
            whole = scratch.get(align_up(end))
            if whole.obj is not view.obj:  # scratch grew into a new mapping: bring the first block
                whole[:first] = view[:first]
            pread_full(fd, whole[first: align_up(end) if direct else end], first, end - first)
            view = whole
    return view[:n], size


def check_header(head: bytes | memoryview, key: bytes, size: int) -> ChunkHeader:
    """The header of a chunk file of ``size`` bytes named for ``key``, or ChunkError."""
    header = decode_header(head)
    if header.key != key:
        raise ChunkError("key_mismatch", "file holds another key's chunk")
    if not header.nbytes <= size <= align_up(header.nbytes):
        raise ChunkError("truncated", f"file has {size} bytes, header says {header.nbytes}")
    return header


def verify(view: memoryview, key: bytes, size: int) -> None:
    """``decode_chunk(verify=True)``'s checks without decompressing: header, key, length
    against the file size, payload checksum."""
    header = check_header(view[:HEADER_SIZE], key, size)
    if view.nbytes < header.nbytes:
        raise ChunkError("truncated", f"{view.nbytes} bytes, header says {header.nbytes}")
    if xxhash.xxh3_64_intdigest(view[HEADER_SIZE : header.nbytes]) != header.checksum:
        raise ChunkError("corrupt", "payload checksum mismatch")


def stale_tmp(entry: os.DirEntry[str]) -> bool:
    """A temp file named ``.<anything>.<pid>-<token>.<seq>.tmp`` (or, from older versions,
    ``.<pid>.<seq>.tmp``) is stale when it is old or its writer is dead; this process's own
    are left alone (another tier object may be writing), a predecessor's under the same pid
    (another token) are not."""
    try:
        if time.time() - entry.stat().st_mtime >= TMP_MAX_AGE_S:
            return True
        pid_text, _, token = entry.name.split(".")[-3].partition("-")
        pid = int(pid_text)
    except (ValueError, IndexError, OSError):
        return True
    if pid == os.getpid():
        return token != WRITER_TOKEN
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, someone else's
        return False
    return False


def unlink(path: str) -> bool:
    """True when a file was removed; a missing one is not an error, nor is a directory
    someone put where a file was expected (it is left alone). A medium that refuses (read-only,
    permissions, I/O error) is logged and answered False: the file stays, and the verb that
    wanted it gone goes on (a failing medium never raises out of a tier's verb)."""
    try:
        os.unlink(path)
        return True
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False
    except OSError as exc:
        log.warning("disk tier: cannot remove %s: %s", path, exc)
        return False


def unlink_if_same(path: str, fd: int) -> bool:
    """Remove ``path`` only while it still names the file open as ``fd``: after a bad read,
    a process sharing the directory may already have put a good chunk there (a new inode),
    which must stay. (The window between the check and the unlink is a few system calls;
    a file replaced inside it is lost as a miss, never read as wrong bytes.)"""
    try:
        mine, now = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
        return False
    return unlink(path)

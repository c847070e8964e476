"""The client's half of the shared-segment handover: the descriptor SHM_READY offers, fetched
over the server's one-shot abstract Unix socket with the offer's ticket (SCM_RIGHTS; no name
in /dev/shm ever exists), and mapped only if its size is sealed (F_SEAL_SHRINK) and at least
what was offered: nothing can then shrink it under this process's mapping (a use would SIGBUS).
Where the offer names an arena, its read-only descriptor comes second and is mapped read-only
on the same condition (GET replies may then reference it: kvtier.server.arena_refs). Every
connection of this process to the same arena (the same memfd) shares one mapping: page tables
are per mapping (a process's connections would each grow their own, ~0.2 % of the bytes they
read), and a page one connection faulted in is then mapped for all.

Threads: any; the shared arena mappings are counted under a lock.

Failure: :func:`map_offer` never raises for a segment it cannot take; it logs why and returns
None, and the connection stays on the socket.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import threading
import time

from kvtier.protocol.frames import ProtocolError, ShmOffer

# The data path's logger: these lines are the data path's, whichever module emits them.
log = logging.getLogger("kvtier.tiers.remote.data_path")
_SHM_SEALED = fcntl.F_SEAL_SHRINK


def map_offer(offer: ShmOffer, deadline: float) -> tuple[mmap.mmap | None, mmap.mmap | None]:
    """(the offered segment mapped read-write, the offered arena mapped read-only); None
    (logged) for what cannot be taken; no arena without the segment."""
    try:
        fds = _fetch_fds(offer, deadline)
    except (OSError, ProtocolError) as exc:
        log.info("data path: cannot map the server's segment (%s): socket only", exc)
        return None, None
    try:
        segment = _map_sealed(fds[0], offer.size, "segment", mmap.PROT_READ | mmap.PROT_WRITE)
        arena = None
        if segment is not None and len(fds) > 1:
            arena = _map_arena(fds[1], offer.arena_size)
        return segment, arena
    finally:
        for fd in fds:
            os.close(fd)


def _map_sealed(fd: int, size: int, what: str, prot: int) -> mmap.mmap | None:
    try:
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SHM_SEALED == _SHM_SEALED
        if sealed and os.fstat(fd).st_size >= size:  # else a use could SIGBUS
            return mmap.mmap(fd, size, prot=prot)
        log.warning("data path: the server's %s is not sealed at %d bytes: not mapped", what, size)
    except OSError as exc:
        log.info("data path: cannot map the server's %s (%s)", what, exc)
    return None


_arenas: dict[tuple[int, int], tuple[mmap.mmap, int]] = {}  # (st_dev, st_ino) -> (mapping, users)
_arenas_lock = threading.Lock()


def _map_arena(fd: int, size: int) -> mmap.mmap | None:
    """The arena behind ``fd`` mapped read-only: this process's mapping of it when it has one
    (a memfd's inode stays unique while mapped), counted once more; :func:`release_arena`
    gives each back."""
    st = os.fstat(fd)
    ident = (st.st_dev, st.st_ino)
    with _arenas_lock:
        known = _arenas.get(ident)
        if known is not None and len(known[0]) >= size:
            _arenas[ident] = (known[0], known[1] + 1)
            return known[0]
        mapping = _map_sealed(fd, size, "arena", mmap.PROT_READ)
        if mapping is not None and known is None:
            _arenas[ident] = (mapping, 1)
        return mapping


def release_arena(mapping: mmap.mmap) -> None:
    """A connection is done with ``mapping`` (from :func:`map_offer`): unmapped with its last
    user (later, by the GC, where a caller still holds a view of it)."""
    with _arenas_lock:
        for ident, (known, users) in list(_arenas.items()):
            if known is mapping:
                if users > 1:
                    _arenas[ident] = (known, users - 1)
                    return
                del _arenas[ident]
                break
    try:
        mapping.close()
    except BufferError:
        pass


def _fetch_fds(offer: ShmOffer, deadline: float) -> list[int]:
    """The segment's descriptor (and the arena's, when offered) from the server's one-shot
    abstract Unix socket."""
    want = 2 if offer.arena_size else 1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as unix:
        unix.settimeout(max(0.001, deadline - time.monotonic()))
        unix.connect("\0" + offer.socket)
        unix.sendall(offer.ticket.encode())
        _, fds, _, _ = socket.recv_fds(unix, 1, want)
    if len(fds) != want:
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"the server's Unix socket sent {len(fds)} descriptors, expected {want}")
    return fds

"""The client's half of the shared-segment handover: the descriptor SHM_READY offers, fetched
over the server's one-shot abstract Unix socket with the offer's ticket (SCM_RIGHTS; no name
in /dev/shm ever exists), and mapped only if its size is sealed (F_SEAL_SHRINK) and at least
what was offered: nothing can then shrink it under this process's mapping (a use would SIGBUS).
Where the offer names an arena, its read-only descriptor comes second and is mapped read-only
on the same condition (GET replies may then reference it: kvtier.server.arena_refs).

Failure: :func:`map_offer` never raises for a segment it cannot take; it logs why and returns
None, and the connection stays on the socket.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
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
            arena = _map_sealed(fds[1], offer.arena_size, "arena", mmap.PROT_READ)
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

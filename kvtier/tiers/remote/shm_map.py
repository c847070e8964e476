"""The client's half of the shared-segment handover: the descriptor SHM_READY offers, fetched
over the server's one-shot abstract Unix socket with the offer's ticket (SCM_RIGHTS; no name
in /dev/shm ever exists), and mapped only if its size is sealed (F_SEAL_SHRINK) and at least
what was offered: nothing can then shrink it under this process's mapping (a use would SIGBUS).

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


def map_offer(offer: ShmOffer, deadline: float) -> mmap.mmap | None:
    """The offered segment mapped read-write, or None (logged) when it cannot be taken."""
    try:
        fd = _fetch_fd(offer, deadline)
        try:
            sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & _SHM_SEALED == _SHM_SEALED
            if sealed and os.fstat(fd).st_size >= offer.size:  # else a use could SIGBUS
                return mmap.mmap(fd, offer.size)
            log.warning("data path: the server's segment is not sealed at %d bytes: socket only", offer.size)
        finally:
            os.close(fd)
    except (OSError, ProtocolError) as exc:
        log.info("data path: cannot map the server's segment (%s): socket only", exc)
    return None


def _fetch_fd(offer: ShmOffer, deadline: float) -> int:
    """The segment's descriptor from the server's one-shot abstract Unix socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as unix:
        unix.settimeout(max(0.001, deadline - time.monotonic()))
        unix.connect("\0" + offer.socket)
        unix.sendall(offer.ticket.encode())
        _, fds, _, _ = socket.recv_fds(unix, 1, 1)
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ProtocolError("the server's Unix socket sent no segment descriptor")
    return fds[0]

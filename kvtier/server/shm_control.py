"""The server's answers to a data connection's shared-memory control frames: SHM_OPEN (make the
connection's segment, offer it and, with arena reads, the tenant's read-only RAM arena, and hand
both descriptors off) and SHM_MAPPED (the client says what it mapped; the segment is used from
then on, or closed).

Failure: a refused open (shared memory off here, a segment already made, no memory for one) is
an error frame and the connection stays on the socket; SHM_MAPPED with no segment pending is a
:class:`~kvtier.protocol.frames.ProtocolError` (the caller hangs up).
Threads: the connection's own thread, with the segment it owns.
"""

from __future__ import annotations

import logging
import socket

import grpc

from kvtier.protocol.frames import (
    MAPPED_ARENA,
    MAPPED_SEGMENT,
    SHM_OPEN,
    ProtocolError,
    ShmOffer,
    encode_error,
    encode_shm_ready,
)
from kvtier.protocol.session import ShmControl
from kvtier.protocol.socket_io import send_all
from kvtier.server.arena_refs import reader_fd
from kvtier.server.shm import Segment
from kvtier.server.storage import TenantStore

log = logging.getLogger("kvtier.server.dataplane")  # the data path's lines, whichever module


def answer_shm_control(sock: socket.socket, store: TenantStore, seg: Segment, request: ShmControl,
                       shm_bytes: int, arena_reads: bool) -> None:
    """Answer ``request`` for the connection ``sock`` of ``store``'s tenant, whose segment is
    ``seg``; ``shm_bytes`` 0 means shared memory is off on this server."""
    if request.type == SHM_OPEN:
        if not shm_bytes or seg.mapping is not None:
            send_all(sock, encode_error(grpc.StatusCode.FAILED_PRECONDITION.value[0],
                                        "shared memory is off on this server" if not shm_bytes
                                        else "this connection has its segment already"))
            return
        arena_fd, arena_size = reader_fd(store) if arena_reads else (-1, 0)
        try:
            seg.create(shm_bytes, arena_fd)
        except OSError as exc:
            log.warning("data path: no shared segment (%s); this connection stays on the socket", exc)
            send_all(sock, encode_error(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], f"no shared segment: {exc}"))
            return
        send_all(sock, encode_shm_ready(ShmOffer(seg.address, seg.ticket, shm_bytes, arena_size)))
        seg.arena_offered = arena_size > 0
        seg.hand_off(sock)
        return
    if not seg.pending:
        raise ProtocolError("SHM_MAPPED without a pending segment")
    if request.ok & MAPPED_SEGMENT:
        seg.view = memoryview(seg.mapping)  # type: ignore[arg-type]  # pending: mapped
        seg.arena_mapped = seg.arena_offered and bool(request.ok & MAPPED_ARENA)
    else:
        seg.close()

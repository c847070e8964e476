"""The two socket loops both ends of the data path share (the framing is in kvtier.protocol.frames).

``send_all`` writes a list of buffers in order with ``sendmsg`` (scatter/gather: a frame
header and a chunk go out in one call, the chunk never joined or copied); TLS sockets have
no ``sendmsg`` and use ``sendall`` per buffer. ``read_frame`` fills a
:class:`~kvtier.protocol.frames.FrameReader`'s buffers with ``recv_into`` until one frame completes.
Both raise what the socket raises (OSError and subclasses, ``ssl.SSLError``) and
``ProtocolError`` for a bad frame.

Plain sockets are best used blocking, with the kernel enforcing the timeouts
(:func:`set_kernel_timeouts`): a socket in Python's timeout mode polls before every call and
cannot use ``MSG_WAITALL``, so a 1 MiB body takes several ``recv_into`` calls (and polls)
instead of one.
"""

from __future__ import annotations

import socket
import ssl
import struct

from kvtier.protocol.frames import Buffers, Frame, FrameReader

_IOV = 512  # buffers per sendmsg call (well under IOV_MAX = 1024)


def send_all(sock: socket.socket, parts: Buffers) -> int:
    """Write ``parts`` in order; returns the bytes written. Plain sockets: one ``sendmsg`` of
    them all in the usual case (no per-part Python after it); a short write goes on from
    where the socket stopped."""
    # bytes as they are (no view made); anything else as a flat byte view: len() counts bytes
    views = [p if type(p) is bytes else memoryview(p).cast("B") for p in parts]
    total = sum(map(len, views))
    if isinstance(sock, ssl.SSLSocket):
        for p in views:
            sock.sendall(p)
        return total
    n = sock.sendmsg(views[:_IOV])
    if n == total:
        return total
    rest = [memoryview(v) for v in views if len(v)]
    while True:
        while n:  # drop what went out
            if n >= rest[0].nbytes:
                n -= rest.pop(0).nbytes
            else:
                rest[0], n = rest[0][n:], 0
        if not rest:
            return total
        n = sock.sendmsg(rest[:_IOV])


def set_kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Bound every later ``recv``/``send`` on blocking ``sock`` by ``seconds`` (SO_RCVTIMEO /
    SO_SNDTIMEO). A call that times out with nothing done raises ``BlockingIOError`` (EAGAIN);
    one that moved some bytes returns the short count."""
    if seconds <= 0:
        raise ValueError(f"timeout must be > 0 s, got {seconds}")
    tv = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6) or 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def read_frame(sock: socket.socket, reader: FrameReader, waitall: bool = False) -> Frame:
    """The next frame. ``waitall`` (blocking plain sockets only): each read asks for exactly
    what the current header or body still needs with ``MSG_WAITALL``, one call per part
    instead of one per segment the kernel happens to hold, and both parts of a split body
    (a PUT's keys and its chunk) in one ``recvmsg_into``. Safe because the reader's buffers
    never span two frames: it waits only for bytes the peer must send anyway."""
    flags = socket.MSG_WAITALL if waitall else 0
    while True:
        split = reader.split_buffers() if waitall else None
        if split is not None:
            n = sock.recvmsg_into(split, 0, flags)[0]
        else:
            n = sock.recv_into(reader.buffer(), 0, flags)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        frame = reader.advance(n)
        if frame is not None:
            return frame

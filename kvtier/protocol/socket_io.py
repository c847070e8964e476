"""The two socket loops both ends of the data path share (the framing is in kvtier.protocol.frames).

``send_all`` writes a list of buffers in order with ``sendmsg`` (scatter/gather: a frame
header and a chunk go out in one call, the chunk never joined or copied); TLS sockets have
no ``sendmsg`` and use ``sendall`` per buffer. ``read_frame`` fills a
:class:`~kvtier.protocol.frames.FrameReader`'s buffers with ``recv_into`` until one frame completes.
Both raise what the socket raises (OSError and subclasses, ``ssl.SSLError``) and
``ProtocolError`` for a bad frame.
"""

from __future__ import annotations

import socket
import ssl

from kvtier.protocol.frames import Buffers, Frame, FrameReader

_IOV = 512  # buffers per sendmsg call (well under IOV_MAX = 1024)


def send_all(sock: socket.socket, parts: Buffers) -> int:
    total = sum(len(p) for p in parts)
    if isinstance(sock, ssl.SSLSocket):
        for p in parts:
            sock.sendall(p)
        return total
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = sock.sendmsg(views[:_IOV])
        while n:
            if n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            else:
                views[0] = views[0][n:]
                n = 0
    return total


def read_frame(sock: socket.socket, reader: FrameReader) -> Frame:
    while True:
        n = sock.recv_into(reader.buffer())
        if n == 0:
            raise ConnectionError("peer closed the connection")
        frame = reader.advance(n)
        if frame is not None:
            return frame

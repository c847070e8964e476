"""The ceilings bench/remote.py measures kvtier against: what a Python server can do on this
machine's loopback socket, and what an inter-process memcpy through shared memory can do.

One server process (``python bench/remote.py --tcp-server PORTFILE`` runs :func:`serve`),
built the way kvtier's data plane is (``kvtier/server/dataplane.py``): a blocking thread per
connection (it releases the GIL in ``recv_into``/``sendmsg``), bodies read with ``recv_into``
and ``MSG_WAITALL`` (at both ends, as kvtier's data path reads: one call per body, which
measured 1.3-1.5x the plain per-segment loop here) straight into one buffer per connection,
replies sent with ``sendmsg`` from a buffer made at start, nothing allocated per operation.
It is a source/sink, not a store: it keeps no index, checks nothing and copies nothing it does
not have to, so it bounds what any socket server written in Python can move here.

Every buffer the kernel copies into or out of is page-aligned (``kvtier.chunk.page_aligned_buffer``),
because on this machine's CPU (AMD EPYC, ``rep movsb`` with FSRM, which the kernel's user copies use)
a copy whose destination lies 1-31 bytes past its source modulo 4096 runs ~5x slower (1.7-2.4
against 9-12 GB/s, measured with ``rep movsb`` in user space; glibc's ``memcpy`` steers clear
of it, the kernel does not). A ``bytearray`` or ``bytes`` this large is its own ``mmap`` with
the data 16 or 48 bytes into a page, and a body on the wire starts near the start of a kernel
page fragment, so the earlier ceiling's put sink (16 bytes in, 9-byte header) took every body
at that cost, and its get receive buffer did or did not, run to run, with the heap's state
(tcp get 2.1-2.6 or 3.1-3.4 GB/s and tcp put ~2.1 GB/s, against 2.7-3.8 and 3.3-4.0 with
page-aligned buffers, 2026-12-03): a receive into a page-aligned buffer, or a send from one
into a fresh fragment, copies at distance 0 or just under 4096. A ceiling must be the best a
Python server does, so it aligns. Requests are a 9-byte header ``<op:1><n:u64>``:

- ``P`` n: the next n bytes are a put body, read into the connection's own sink (n distinct
  bytes of memory per connection, as a store keeps what each client puts); reply ``k``.
- ``G`` n: reply with the first n bytes of the connection's own source (random bytes written
  at connect: each connection reads distinct memory, as each kvtier client reads its own keys).
- ``Q`` n / ``H`` n: the same with the old cache-hot buffers: a put body lands 1 MiB at a time
  in one reused window, and every connection's get sends the same shared payload. With 4
  clients that is 8 MiB of source for all of them against the 32 MiB of distinct values kvtier
  serves: it can stay in a last-level cache where a store's working set does not, so these
  measure the socket with less memory traffic (``*_vs_tcp_hot`` keys).
- ``M`` n: the next n bytes name a /dev/shm file the client made; map it for this connection.
- ``p`` n: copy n bytes from the mapped segment into the sink (the server's half of a put
  through shared memory); reply ``k``.
- ``g`` n: copy n bytes of the connection's source into the mapped segment (the server's half
  of a get through a segment); reply ``k``.
- ``r`` n: reply ``k`` at once: the client copies n bytes straight out of the segment, as if
  it were the server's own memory mapped into the client (the get of kvtier's arena reads,
  kvtier.server.arena_refs: one copy).

The same process also runs the old baseline on a second port: a single-threaded asyncio
source/sink (``tcp-asyncio``: one core for every client, and ``transport.write`` copies the
unsent part of each reply). It is measured only to show what the old "loopback limit" was.

With ``p``/``g`` the client copies its values into the segment (put) or out of it into its own
buffer (get): two memcpys and two 1-byte messages per batch, what kvtier's shm path does for a
put (and did for a get before arena reads) plus its framing, index and checksums. With ``r``
the get is one memcpy and two 1-byte messages: the least work moving bytes from one process's
memory into another's takes, which is what a kvtier get with arena reads does. Clients are :class:`LoopbackClient` (one socket each, all
buffers allocated up front). Failure: any socket error ends that connection's thread.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import secrets
import socket
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import cast

from kvtier.chunk import page_aligned_buffer

HEAD = struct.Struct("<cQ")
MAX_BODY = 16 << 20  # larger than any batch bench/remote.py sends (8 MiB + chunk headers)
WINDOW = 1 << 20  # a ``Q`` put body lands here piece by piece: that sink keeps nothing


def _random_source(nbytes: int) -> memoryview:
    """A page-aligned buffer of random bytes (written, so not the kernel's shared zero page)."""
    source = page_aligned_buffer(nbytes)
    source[:] = os.urandom(nbytes)
    return source


def _recv_exact(conn: socket.socket, view: memoryview) -> bool:
    """Fill ``view`` with ``recv_into``, ``MSG_WAITALL`` as kvtier's data path reads (one call
    per body rather than one per segment the kernel holds); False on a clean EOF before the
    first byte."""
    got = 0
    while got < view.nbytes:
        n = conn.recv_into(view[got:], 0, socket.MSG_WAITALL)
        if n == 0:
            if got:
                raise ConnectionError("peer closed mid-message")
            return False
        got += n
    return True


def _send_exact(conn: socket.socket, view: memoryview) -> None:
    """``sendmsg`` until all of ``view`` is out (one call for the whole body when it fits)."""
    while view.nbytes:
        view = view[conn.sendmsg([view]):]


def _serve_conn(conn: socket.socket, payload: memoryview) -> None:
    """One connection's thread: every buffer it uses is made here, once (``payload`` is the
    shared cache-hot source of ``H``)."""
    head = memoryview(bytearray(HEAD.size))
    sink = page_aligned_buffer(MAX_BODY)
    source = _random_source(MAX_BODY)
    name = memoryview(bytearray(256))
    ack = memoryview(b"k")
    seg: mmap.mmap | None = None
    segv: memoryview | None = None
    try:
        while _recv_exact(conn, head):
            op, n = HEAD.unpack(head)
            if n > MAX_BODY:
                raise ValueError(f"body of {n} bytes over {MAX_BODY}")
            if op == b"P":
                _recv_exact(conn, sink[:n])
                _send_exact(conn, ack)
            elif op == b"Q":  # into a 1 MiB window reused, as the asyncio sink does: cache-hot
                left = n
                while left:
                    take = min(left, WINDOW)
                    _recv_exact(conn, sink[:take])
                    left -= take
                _send_exact(conn, ack)
            elif op in (b"G", b"H"):
                _send_exact(conn, (source if op == b"G" else payload)[:n])
            elif op == b"M":
                _recv_exact(conn, name[:n])
                fd = os.open(bytes(name[:n]).decode(), os.O_RDWR)
                try:
                    seg = mmap.mmap(fd, MAX_BODY)
                finally:
                    os.close(fd)
                segv = memoryview(seg)
                _send_exact(conn, ack)
            elif op in (b"p", b"g", b"r") and segv is not None:
                if op == b"p":
                    sink[:n] = segv[:n]
                elif op == b"g":
                    segv[:n] = source[:n]
                _send_exact(conn, ack)
            else:
                raise ValueError(f"unknown op {op!r}")
    finally:
        segv = None
        if seg is not None:
            seg.close()
        conn.close()


class _AsyncioSourceSink(asyncio.BufferedProtocol):
    """The old baseline: ``P``/``G`` only, on one event loop."""

    def __init__(self, payload: memoryview) -> None:
        self.payload = payload
        self.buf = bytearray(1 << 20)
        self.head = bytearray()
        self.sink_left = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        data = memoryview(self.buf)[:nbytes]
        while data:
            if self.sink_left:
                take = min(self.sink_left, len(data))
                self.sink_left -= take
                data = data[take:]
                if not self.sink_left:
                    self.transport.write(b"k")
                continue
            need = HEAD.size - len(self.head)
            self.head += data[:need]
            data = data[need:]
            if len(self.head) == HEAD.size:
                op, n = HEAD.unpack(self.head)
                self.head = bytearray()
                if op == b"P":
                    self.sink_left = n
                else:
                    self.transport.write(self.payload[:n])


def _serve_asyncio(payload: memoryview, ready: list[int], started: threading.Event) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(
            lambda: _AsyncioSourceSink(payload), "127.0.0.1", 0)
        ready.append(server.sockets[0].getsockname()[1])
        started.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def serve(port_file: str) -> None:
    """Listen on two free loopback ports (the threaded server's, then the asyncio one's,
    written to ``port_file``); serve until killed."""
    payload = _random_source(MAX_BODY)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    ports: list[int] = []
    started = threading.Event()
    threading.Thread(target=_serve_asyncio, args=(payload, ports, started), daemon=True).start()
    started.wait(30)
    tmp = port_file + ".tmp"
    Path(tmp).write_text(f"{listener.getsockname()[1]} {ports[0]}")
    os.replace(tmp, port_file)  # readers never see half a file
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_serve_conn, args=(conn, payload), daemon=True).start()


class LoopbackClient:
    """One connection to :func:`serve` moving one batch of ``values`` per call; every buffer
    (the receive buffer, the shared segment) is allocated here, once."""

    def __init__(self, port: int, values: Sequence[bytes], hot: bool = False) -> None:
        self.values = [memoryview(v) for v in values]
        self.nbytes = sum(v.nbytes for v in self.values)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.recv_buf = page_aligned_buffer(self.nbytes)
        self.ack = memoryview(bytearray(1))
        # hot: the old cache-hot sink window and shared source (``Q``/``H``; see the module doc)
        self.put_head = HEAD.pack(b"Q" if hot else b"P", self.nbytes)
        self.get_head = HEAD.pack(b"H" if hot else b"G", self.nbytes)
        self.memcpy_put_head = HEAD.pack(b"p", self.nbytes)
        self.memcpy_get_head = HEAD.pack(b"g", self.nbytes)
        self.memcpy_read_head = HEAD.pack(b"r", self.nbytes)
        self.seg: mmap.mmap | None = None
        self.segv: memoryview | None = None

    def _ack(self) -> None:
        if not _recv_exact(self.sock, self.ack) or self.ack[0] != ord("k"):
            raise ConnectionError("loopback server did not acknowledge")

    def tcp_put(self) -> None:
        views = [memoryview(self.put_head), *self.values]
        while views:  # scatter/gather, like kvtier's send_all
            n = self.sock.sendmsg(views)
            while n:
                if n >= views[0].nbytes:
                    n -= views.pop(0).nbytes
                else:
                    views[0], n = views[0][n:], 0
        self._ack()

    def tcp_get(self) -> None:
        self.sock.sendall(self.get_head)
        _recv_exact(self.sock, self.recv_buf)

    def map_segment(self) -> None:
        path = f"/dev/shm/kvtier-bench-{os.getpid()}-{secrets.token_hex(8)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, MAX_BODY)
            self.seg = mmap.mmap(fd, MAX_BODY)
            name = path.encode()
            self.sock.sendall(HEAD.pack(b"M", len(name)) + name)
            self._ack()
        finally:
            os.close(fd)
            os.unlink(path)  # both sides hold their mapping; nothing is left in /dev/shm
        self.segv = memoryview(self.seg)

    def memcpy_put(self) -> None:
        if self.segv is None:
            self.map_segment()
        assert self.segv is not None
        off = 0
        for v in self.values:
            self.segv[off : off + v.nbytes] = v
            off += v.nbytes
        self.sock.sendall(self.memcpy_put_head)
        self._ack()

    def memcpy_get(self, copies: int = 1) -> None:
        """One copy (``r``: out of the server's shared memory) or two (``g``: the server's copy
        into the segment, then ours out of it)."""
        if self.segv is None:
            self.map_segment()
        assert self.segv is not None
        self.sock.sendall(self.memcpy_read_head if copies == 1 else self.memcpy_get_head)
        self._ack()
        self.recv_buf[:] = self.segv[: self.nbytes]

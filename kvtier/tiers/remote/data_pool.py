"""The connection pool of a kvtier-server data port: connect + handshake, check out, check in.

A verb of :class:`~kvtier.tiers.remote.data_path.SocketDataPath` checks one connection out,
runs one request on it and checks it back in: ``ok=True`` returns it to the idle pool, ``False``
closes it (its framing is lost after a failure or a timeout mid-request). At most
``connections`` are out at once; further callers wait for a slot within their deadline.

A new connection connects (TCP, TLS when the node asks for it), sends HELLO with the token,
reads WELCOME (the ops the node serves) and, with ``shm=True``, maps a shared segment; a
segment that cannot be mapped clears ``shm`` so later connections stay on the socket.
Failures are :class:`~kvtier.tiers.remote.errors.NodeError`: the caller running out of time
before anything was sent is ``down=False`` (not the node's fault), a refused handshake or an
I/O error ``down=True``.

Threads: every method may be called from any thread; the idle list and ``closed`` change
under a lock, the slots are a bounded semaphore.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time

from kvtier.protocol.frames import ERROR as FRAME_ERROR
from kvtier.protocol.frames import (
    ProtocolError,
    WireLimits,
    encode_hello,
    parse_text,
    parse_welcome,
    welcome_ops,
)
from kvtier.protocol.socket_io import send_all
from kvtier.tiers.base import ERROR, NODE_DOWN, TIMEOUT
from kvtier.tiers.remote.batching import RequestCutter
from kvtier.tiers.remote.data_conn import DataConn
from kvtier.tiers.remote.errors import REQUEST_CODES, NodeError, io_error, no_time_left
from kvtier.tiers.remote.heap import retain_freed_blocks


class DataConnPool:
    """Connections to one data port; see the module docstring."""

    def __init__(self, host: str, port: int, token: str, tls: ssl.SSLContext | None,
                 server_hostname: str, limits: WireLimits, connections: int, shm: bool = False) -> None:
        self.host = host
        self.port = port
        self.token = token
        self.tls = tls
        self.server_hostname = server_hostname
        self.limits = limits
        self.shm = shm  # still wanted: cleared when a segment cannot be mapped
        self._cut = RequestCutter(limits.max_batch_keys)  # requests cut to fit the segment
        self._idle: list[DataConn] = []
        self._slots = threading.BoundedSemaphore(connections)
        self._lock = threading.Lock()
        self._closed = False
        retain_freed_blocks()  # get's fresh chunk bytes reuse freed heap pages (kvtier.tiers.remote.heap)

    # --- connections ------------------------------------------------------------------------------
    def connect(self, deadline: float) -> DataConn:
        left = deadline - time.monotonic()
        if left <= 0:  # the caller is late, the node did nothing wrong: not a reason to mark it down
            raise NodeError(TIMEOUT, f"data path {self.host}:{self.port}: no time left to connect", down=False)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=left)
        except TimeoutError:
            raise NodeError(TIMEOUT, f"data path {self.host}:{self.port}: connect timed out", down=True) from None
        except OSError as exc:
            raise NodeError(NODE_DOWN, f"data path {self.host}:{self.port}: {exc}", down=True) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_hostname=self.server_hostname)
            else:
                sock.settimeout(None)  # blocking; deadlines come from SO_RCVTIMEO/SO_SNDTIMEO
            conn = DataConn(sock, self.limits)
            if not conn.arm(deadline):  # connected, nothing sent yet: the caller is late
                raise no_time_left(f"data path {self.host}:{self.port} handshake")
            send_all(conn.sock, encode_hello(self.token))
            frame = conn.read(deadline)
            if frame.type == FRAME_ERROR:
                code = REQUEST_CODES.get(frame.header.count, "UNKNOWN")
                raise NodeError(ERROR, f"data path {self.host}:{self.port}: {code}: {parse_text(frame)}", down=True, code=code)
            conn.ops = welcome_ops(parse_welcome(frame))
            if self.shm and not conn.open_shm(deadline):
                self.shm = False
            if conn.shm is not None:
                self._cut.segment_bytes = conn.shm.nbytes
            return conn
        except NodeError:
            sock.close()
            raise
        except (OSError, ProtocolError, ssl.SSLError) as exc:
            sock.close()
            raise io_error(exc, f"data path {self.host}:{self.port} handshake") from None

    def _checkout(self, deadline: float) -> DataConn:
        """A connection for one request (idle or new), waiting for one within ``deadline``."""
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise NodeError(TIMEOUT, f"data path {self.host}:{self.port}: no free connection in time", down=False)
        return self._take(deadline)

    def _checkout_armed(self, deadline: float, what: str) -> DataConn:
        """:meth:`_checkout`, with the connection's socket deadline armed for a request. No time
        left before anything was sent is the caller's lateness (a wave or a retry that started
        late), never the node's: NodeError(TIMEOUT, down=False), the connection back in the pool."""
        conn = self._checkout(deadline)
        if not conn.arm(deadline):
            self._checkin(conn, True)
            raise no_time_left(f"data path {self.host}:{self.port} {what}")
        return conn

    def _checkout_now(self, deadline: float) -> DataConn | None:
        """A connection if one is free now (idle or new), else None: no wait."""
        return self._take(deadline) if self._slots.acquire(blocking=False) else None

    def _take(self, deadline: float) -> DataConn:
        """With a slot held: an idle connection, or a new one (the slot is given back if that fails)."""
        with self._lock:
            if self._closed:
                self._slots.release()
                raise NodeError(NODE_DOWN, "data path closed", down=False)
            if self._idle:
                conn = self._idle.pop()
                conn.reused = True
                return conn
        try:
            return self.connect(deadline)
        except BaseException:
            self._slots.release()
            raise

    def handshake(self, deadline: float) -> None:
        """Connect and authenticate one connection now (it joins the idle pool), so that a node
        whose data path is unusable is found at start-up rather than on the first verb.
        Raises :class:`NodeError` as the verbs do."""
        self._checkin(self._checkout(deadline), True)

    def _checkin(self, conn: DataConn, ok: bool) -> None:
        conn.targets = None
        conn.overflow = {}
        conn.following = 0
        with self._lock:
            if ok and not self._closed:
                self._idle.append(conn)
                conn = None  # type: ignore[assignment]
        if conn is not None:
            conn.close()
        self._slots.release()

    @property
    def kind(self) -> str:
        return "shm" if self.shm else "socket"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def drop_idle(self) -> None:
        """Close every idle connection (the peer closed them: a restart, or its idle timeout)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

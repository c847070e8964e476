"""Scheduler -> worker lookups over a private Unix socket.

Why: in vLLM V1 the scheduler runs in the EngineCore process and each worker in its own process
(the CPU platform forces the multiprocessing executor). The store, and with it the process-local
cpu tier, lives in the worker, so the scheduler asks the worker: one local round trip
(~0.1 ms) per lookup, and the worker can start the prefetch the very moment it answers.

Wire format (no pickle: nothing received is ever executed): a frame is ``<u32 header length>
<JSON header> <u32 blob length> <blob>``; the blob carries token ids as uint32-LE.
The socket lives in a 0700 directory owned by this user, so only this user's processes connect.

Failure: the client never raises and never waits longer than its timeout; a late or failed
call returns None (the connector then reports a miss) and the connection is re-opened next time.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.protocol.accept import Acceptor

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")
MAX_FRAME = 64 << 20
Handler = Callable[[dict[str, Any], bytes], dict[str, Any]]


def socket_path(engine_id: str, dp_rank: int, rank: int, directory: str = "") -> str:
    """Path of one worker's lookup socket; the directory is created 0700 and must be ours."""
    base = Path(directory) if directory else Path(tempfile.gettempdir()) / f"kvtier-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = base.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{base} must be owned by uid {os.getuid()} with mode 0700")
    safe = "".join(ch for ch in engine_id if ch.isalnum() or ch in "-_")[:40] or "engine"
    return str(base / f"{safe}-dp{dp_rank}-r{rank}.sock")


def _send(sock: socket.socket, header: dict[str, Any], blob: bytes = b"") -> None:
    head = json.dumps(header, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(head)) + head + _LEN.pack(len(blob)) + blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the lookup socket")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    (hlen,) = _LEN.unpack(_recv_exact(sock, 4))
    if hlen > MAX_FRAME:
        raise ConnectionError(f"header of {hlen} bytes is over the frame limit")
    try:
        header = json.loads(_recv_exact(sock, hlen))
    except (ValueError, RecursionError) as exc:
        raise ConnectionError(f"lookup header is not JSON: {exc!r:.200}") from None
    (blen,) = _LEN.unpack(_recv_exact(sock, 4))
    if blen > MAX_FRAME:
        raise ConnectionError(f"blob of {blen} bytes is over the frame limit")
    if not isinstance(header, dict):
        raise ConnectionError("lookup header is not a JSON object")
    return header, _recv_exact(sock, blen) if blen else b""


class LookupServer:
    """Serves ``handler(header, blob) -> reply`` on a Unix socket, one thread per connection."""

    def __init__(self, path: str, handler: Handler,
                 thread_init: Callable[[], None] | None = None) -> None:
        self.path = path
        self._handler = handler
        self._thread_init = thread_init
        if os.path.exists(path):
            os.unlink(path)  # a stale socket of a previous engine with the same id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(16)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept_loop, name="kvtier-lookup", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()  # connection threads inherit this thread's CPU mask
        # Out of descriptors (EMFILE) the lookups wait and resume; only close() ends the loop.
        acceptor = Acceptor(self._sock, lambda: self._closed, "kvtier lookup socket")
        while (accepted := acceptor.next()) is not None:
            conn, _ = accepted
            with self._conns_lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._serve_conn(conn)
            finally:
                with self._conns_lock:
                    self._conns.discard(conn)

    def _serve_conn(self, conn: socket.socket) -> None:
        while not self._closed:
            try:
                header, blob = _recv(conn)
            except (ConnectionError, OSError, ValueError):
                return
            try:
                reply = self._handler(header, blob)
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("lookup request refused: %s", exc)
                reply = {"error": str(exc)}
            try:
                _send(conn, reply)
            except OSError:
                return

    def close(self) -> None:
        self._closed = True
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer
        try:
            self._sock.close()
        finally:
            if os.path.exists(self.path):
                os.unlink(self.path)


class LookupClient:
    """One persistent connection to a worker's ``LookupServer``; ``call`` never raises."""

    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.failures = 0

    def call(self, header: dict[str, Any], blob: bytes = b"") -> dict[str, Any] | None:
        with self._lock:
            try:
                if self._sock is None:
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect(self.path)
                    self._sock = sock
                _send(self._sock, header, blob)
                reply, _ = _recv(self._sock)
                return reply
            except (OSError, ConnectionError, ValueError) as exc:
                # Timeout, worker not up yet, worker gone: a miss. Drop the connection so a late
                # reply can never be read as the answer to the next question.
                self.failures += 1
                if self.failures in (1, 10, 100) or self.failures % 1000 == 0:
                    log.warning("kvtier lookup via %s failed (%s); treating as a miss", self.path, exc)
                self.close_locked()
                return None

    def close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()

"""Who may hold a data-path connection: a small cap and a hard deadline for peers that have
not authenticated, the real cap (``max_data_connections``) for tenants that have.

Why two caps: a peer with no token must not be able to hold the slots real tenants need
(256 bare connections trickling a byte every few seconds once did). An unauthenticated
connection gets ``handshake_s`` in all, not per ``recv``, after which the reaper shuts its
socket down (that wakes its thread, TLS handshake included); when ``max_pending`` are
waiting, a new one pushes out the oldest, so a flood costs its sender the race and a real
client's handshake (a millisecond) still gets through. One tenant may hold at most
``max_per_tenant`` connections: each costs the server up to ``shm_bytes`` of segment and
``max_chunk_bytes`` of scratch, memory no quota counts, so one tenant cannot take it all.

Threads: every method may be called from any thread (one lock); the reaper is a daemon
thread started by :meth:`start` and ended by :meth:`stop`.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter, OrderedDict


class Conn:
    """One accepted connection; ``sock`` is replaced by its TLS wrapper once wrapped.

    :meth:`shutdown` works on the descriptor, not the object: during a TLS handshake the
    plain socket is already detached and the wrapper not yet returned. The owner calls
    :meth:`Admission.leave` before closing the socket, so a shutdown never reaches a
    descriptor number the kernel has handed to someone else."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.idle = True  # between requests (drained at once on SIGTERM)

    def shutdown(self) -> None:
        try:
            view = socket.socket(fileno=self.fd)
        except OSError:
            return
        try:
            view.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it with EOF
        except OSError:
            pass
        finally:
            view.detach()


class Admission:
    def __init__(self, max_authenticated: int, max_pending: int, handshake_s: float,
                 max_per_tenant: int = 0) -> None:
        self.max_authenticated = max_authenticated
        self.max_per_tenant = max_per_tenant or max_authenticated
        self.max_pending = max_pending
        self.handshake_s = handshake_s
        self._lock = threading.Lock()
        self._pending: OrderedDict[Conn, float] = OrderedDict()  # -> deadline, oldest first
        self._authenticated: dict[Conn, str] = {}  # -> tenant
        self._per_tenant: Counter[str] = Counter()
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self.evicted = 0  # pending connections pushed out or past their deadline

    def start(self) -> None:
        self._reaper = threading.Thread(target=self._reap, name="kvtier-data-reaper", daemon=True)
        self._reaper.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for the reaper to end (after :meth:`stop`)."""
        if self._reaper is not None:
            self._reaper.join(timeout)

    def arrive(self, conn: Conn) -> None:
        """A new, unauthenticated connection; the oldest waiting one goes if there are too many."""
        with self._lock:
            self._pending[conn] = time.monotonic() + self.handshake_s
            out = []
            while len(self._pending) > self.max_pending:
                out.append(self._pending.popitem(last=False)[0])
            self.evicted += len(out)
            for old in out:
                old.shutdown()

    def authenticate(self, conn: Conn, tenant: str) -> str:
        """The connection authenticated as ``tenant``: "" if it may stay, else why not (no
        slot left, the tenant's own cap reached, or its handshake time ran out meanwhile)."""
        with self._lock:
            if self._pending.pop(conn, None) is None:
                return f"handshake took longer than {self.handshake_s:g}s"
            if len(self._authenticated) >= self.max_authenticated:
                return f"max_data_connections={self.max_authenticated} reached"
            if self._per_tenant[tenant] >= self.max_per_tenant:
                return f"max_data_connections_per_tenant={self.max_per_tenant} reached for {tenant!r}"
            self._authenticated[conn] = tenant
            self._per_tenant[tenant] += 1
            return ""

    def leave(self, conn: Conn) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            tenant = self._authenticated.pop(conn, None)
            if tenant is not None:
                self._per_tenant[tenant] -= 1

    def counts(self) -> tuple[int, int]:
        """(pending, authenticated) connections now."""
        with self._lock:
            return len(self._pending), len(self._authenticated)

    def _reap(self) -> None:
        while not self._stop.wait(0.2):
            now = time.monotonic()
            with self._lock:
                late = [c for c, deadline in self._pending.items() if deadline <= now]
                for conn in late:
                    del self._pending[conn]
                    conn.shutdown()
                self.evicted += len(late)

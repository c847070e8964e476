"""``accept()`` for a thread-per-connection listener that only closing the listener ends.

Why: ``accept()`` fails for reasons that pass. EMFILE/ENFILE when the process or the host is
out of descriptors — a flood of idle connections on any of the server's ports can do that —
and ENOBUFS/ENOMEM under memory pressure: the connection waits in the kernel's backlog, so
the listener waits a moment and tries again. ECONNABORTED, EPROTO, EPERM (a peer that hung up
before it was accepted, a firewall rule): that connection is skipped. A listener that ended
its accept loop on the first of these (kvtier-server's data plane did) kept its process
looking healthy while it never took another connection.

Used by kvtier-server's data plane and the vLLM connector's lookup socket; the server's
asyncio listeners get the same treatment from :mod:`kvtier.server.fd_limits`.

Threads: one :class:`Acceptor` per listener, used by that listener's accept thread only.
"""

from __future__ import annotations

import errno
import logging
import math
import socket
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_S = 0.05  # wait before trying again when out of a resource (the backlog holds the peer)
LOG_EVERY_S = 10.0  # one warning per this many seconds of trouble, with the count so far


class ExhaustedCount:
    """Counts accept() failures for lack of descriptors or memory on one listener and logs
    one warning per ``LOG_EVERY_S`` with the count so far (a flood fails thousands a second)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.count = 0
        self._warned_at = -math.inf

    def record(self, exc: OSError) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._warned_at >= LOG_EVERY_S:
            self._warned_at = now
            log.warning("%s: accept failed (%s), %d time(s) so far: new connections wait until "
                        "descriptors or memory are free; raise the process's open-files limit "
                        "(ulimit -n, LimitNOFILE=) if this is load, not a flood",
                        self.what, exc.strerror or exc, self.count)


class Acceptor:
    """Accepts from ``listener`` until it is closed or ``draining()`` says so.

    ``exhausted.count``: the accept() calls that failed for lack of descriptors or memory."""

    def __init__(self, listener: socket.socket, draining: Callable[[], bool], what: str) -> None:
        self.listener = listener
        self.draining = draining
        self.what = what
        self.exhausted = ExhaustedCount(what)

    def next(self) -> tuple[socket.socket, Any] | None:
        """The next connection and its peer address, or None once the listener is closed."""
        while True:
            try:
                return self.listener.accept()
            except OSError as exc:
                if self.draining() or self.listener.fileno() < 0 or exc.errno in (errno.EBADF, errno.EINVAL):
                    return None  # closed or shut down: the server is draining
                if exc.errno not in EXHAUSTED:
                    log.debug("%s: accept failed, that connection is skipped: %s", self.what, exc)
                    continue
                self.exhausted.record(exc)
                time.sleep(RETRY_S)

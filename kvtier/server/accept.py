"""``accept()`` for a thread-per-connection listener that only a closed listener ends.

Why: ``accept()`` fails for reasons that pass. EMFILE/ENFILE when the process or the host is
out of descriptors — a flood of idle connections on any of the server's ports can do that —
and ENOBUFS/ENOMEM under memory pressure: the connection waits in the kernel's backlog, so
the listener waits a moment and tries again. ECONNABORTED, EPROTO, EPERM (a peer that hung up
before it was accepted, a firewall rule): that connection is skipped. A data plane that ended
its accept loop on the first of these kept answering health checks while it never took
another client for the rest of its life.

The same trouble on the asyncio loop's listeners is logged by :class:`LoopAcceptErrors`, and
:func:`raise_open_files_limit` lifts the soft limit to the hard one at start.

Threads: one :class:`Acceptor` per listener, used by that listener's accept thread only;
:class:`LoopAcceptErrors` runs on the loop.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
RETRY_S = 0.05  # wait before trying again when out of a resource (the backlog holds the peer)
LOG_EVERY_S = 10.0  # one warning per this many seconds of trouble, with the count so far


class Acceptor:
    """Accepts from ``listener`` until it is closed or ``draining()`` says so.

    ``exhausted`` counts the accept() calls that failed for lack of descriptors or memory."""

    def __init__(self, listener: socket.socket, draining: Callable[[], bool], what: str) -> None:
        self.listener = listener
        self.draining = draining
        self.what = what
        self.exhausted = 0
        self._warned_at = -math.inf

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
                self.exhausted += 1
                now = time.monotonic()
                if now - self._warned_at >= LOG_EVERY_S:
                    self._warned_at = now
                    log.warning("%s: accept failed (%s), %d time(s) so far: new connections wait "
                                "until descriptors or memory are free; raise the process's "
                                "open-files limit (ulimit -n, LimitNOFILE=) if this is load, not "
                                "a flood", self.what, exc.strerror or exc, self.exhausted)
                time.sleep(RETRY_S)


class LoopAcceptErrors:
    """An asyncio exception handler for the server's loop: asyncio's own listeners (the HTTP
    side) report "socket.accept() out of system resource" with a traceback per failed accept
    (several per event) and retry by themselves a second later; this logs one line per
    ``LOG_EVERY_S`` instead and hands every other report to the loop's default handler."""

    def __init__(self) -> None:
        self.exhausted = 0
        self._warned_at = -math.inf

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in EXHAUSTED
                and "accept" in str(context.get("message", ""))):
            loop.default_exception_handler(context)
            return
        self.exhausted += 1
        now = time.monotonic()
        if now - self._warned_at >= LOG_EVERY_S:
            self._warned_at = now
            log.warning("HTTP side: accept failed (%s), %d time(s) so far: new connections wait "
                        "until descriptors or memory are free", exc.strerror or exc, self.exhausted)


def raise_open_files_limit() -> int:
    """Raise this process's soft open-files limit to its hard limit (a container's soft 1024 is
    a few hundred connections on three ports); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # e.g. above the kernel's nr_open
            log.info("open-files limit stays at %d: %s", soft, exc)
    return soft

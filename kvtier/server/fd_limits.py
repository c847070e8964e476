"""The server process's open-files limit, and what its asyncio listeners do when it is reached.

Thread listeners use :class:`kvtier.protocol.accept.Acceptor`; the asyncio loop's own
listeners (the HTTP side) retry by themselves, and :class:`LoopAcceptErrors` keeps their
reports to one log line per ``LOG_EVERY_S``. :func:`raise_open_files_limit` runs at start.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from kvtier.protocol.accept import EXHAUSTED, ExhaustedCount

log = logging.getLogger(__name__)


class LoopAcceptErrors:
    """An asyncio exception handler for the server's loop: asyncio's own listeners (the HTTP
    side) report "socket.accept() out of system resource" with a traceback per failed accept
    (several per event) and retry by themselves a second later; this logs one line per
    ``LOG_EVERY_S`` instead and hands every other report to the loop's default handler."""

    def __init__(self) -> None:
        self.exhausted = ExhaustedCount("HTTP side")

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        if isinstance(exc, OSError) and exc.errno in EXHAUSTED and "accept" in str(context.get("message", "")):
            self.exhausted.record(exc)
        else:
            loop.default_exception_handler(context)


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

"""The HTTP side port: ``/metrics`` (Prometheus text), ``/healthz``, ``/api/stats`` (JSON), and
the cluster dashboard: ``/dashboard`` (one self-contained page) over ``/api/cluster`` (this
node's stats and its ``peers``', see :mod:`kvtier.server.dashboard`).

A deliberately tiny HTTP/1.1 responder on the server's asyncio loop (stdlib only, no new
dependency): GET only, one request per connection, bounded header size and read time.
It exposes usage figures only (tenant names, bytes, counts), never keys or chunk bytes, and
needs no token: bind the server to a trusted interface or firewall the port if tenant names
are sensitive. At most ``MAX_WAITING`` connections wait for their request at once (a new one
cuts the oldest), so idle peers cannot hold the process's descriptors. Handlers are cheap
reads of in-memory counters, so they run on the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.server import dashboard

log = logging.getLogger(__name__)
_MAX_HEAD = 16 << 10
_READ_TIMEOUT_S = 5.0
# Connections waiting for their request head at once; a new one cuts the oldest. Each holds a
# descriptor for up to _READ_TIMEOUT_S: without a cap, idle peers could use up the open-files
# limit the data path and gRPC need. A real client sends its request as it connects, so a
# flood of idle peers costs them the race, not a scraper its answer.
MAX_WAITING = 64


class HttpSide:
    """``stats`` returns the /api/stats document; ``metrics`` the exposition bytes;
    ``serving`` says whether /healthz answers 200 (503 while draining); ``peers`` are the
    other servers' ``host:http_port`` that /api/cluster asks (each within
    ``dashboard.PEER_TIMEOUT_S``; a dead one is shown down)."""

    def __init__(self, stats: Callable[[], dict[str, Any]], metrics: Callable[[], bytes],
                 serving: Callable[[], bool], peers: Sequence[str] = ()) -> None:
        self.stats = stats
        self.metrics = metrics
        self.serving = serving
        self.peers = tuple(peers)
        self._page: bytes | None = None
        self._waiting: OrderedDict[asyncio.StreamWriter, None] = OrderedDict()  # oldest first; loop only
        self.server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await self._read_head(reader, writer)
            status, ctype, body = await self._respond(head)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError):
            status, ctype, body = 400, "text/plain", b"bad request\n"
        except UnicodeDecodeError:
            status, ctype, body = 400, "text/plain", b"bad request\n"
        try:
            writer.write(_response(status, ctype, body))
            await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def _read_head(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        """The request head, within _READ_TIMEOUT_S. With MAX_WAITING connections already
        waiting for theirs, the oldest of them is cut first (it gets a 400)."""
        if len(self._waiting) >= MAX_WAITING:
            oldest, _ = self._waiting.popitem(last=False)
            oldest.transport.abort()
        self._waiting[writer] = None
        try:
            return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
        finally:
            self._waiting.pop(writer, None)

    async def _respond(self, head: bytes) -> tuple[int, str, bytes]:
        if len(head) > _MAX_HEAD:
            return 431, "text/plain", b"request header too large\n"
        line = head.split(b"\r\n", 1)[0].decode("ascii")
        parts = line.split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, "text/plain", b"bad request line\n"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method != "GET":
            return 405, "text/plain", b"only GET\n"
        if target == "/metrics":
            return 200, "text/plain; version=0.0.4; charset=utf-8", self.metrics()
        if target == "/healthz":
            ok = self.serving()
            return (200, "text/plain", b"ok\n") if ok else (503, "text/plain", b"draining\n")
        if target == "/api/stats":
            return 200, "application/json", json.dumps(self.stats(), indent=1).encode() + b"\n"
        if target == "/api/cluster":  # waits on the peers (concurrently, bounded by their timeout)
            doc = await dashboard.cluster(self.stats(), self.peers)
            return 200, "application/json", json.dumps(doc).encode() + b"\n"
        if target in ("/dashboard", "/"):
            if self._page is None:
                self._page = dashboard.dashboard_html()
            return 200, "text/html; charset=utf-8", self._page
        return 404, "text/plain", b"not found: try /dashboard, /metrics, /healthz, /api/stats, /api/cluster\n"


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 503: "Service Unavailable"}


# The page may only talk to this node: no CDN, font or beacon can load even if one slipped in.
_CSP = ("Content-Security-Policy: default-src 'none'; script-src 'unsafe-inline'; "
        "style-src 'unsafe-inline'; connect-src 'self'; img-src data:\r\n")


def _response(status: int, ctype: str, body: bytes) -> bytes:
    extra = _CSP if ctype.startswith("text/html") else ""
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nCache-Control: no-store\r\n{extra}"
            f"Connection: close\r\n\r\n").encode()
    return head + body

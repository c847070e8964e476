"""Client of a kvtier-server data port (kvtier.protocol.frames frames over TCP or TLS).

A small pool of connections per node (:class:`~kvtier.tiers.remote.data_pool.DataConnPool`);
a verb checks one out, runs one request on it and puts it back, so concurrent callers use
separate connections (up to ``connections``, then they wait for one within their deadline). A
connection that fails or times out mid-request is closed (its framing is lost), never reused.

Shared memory (``shm=True``, same host): each connection asks the server for a segment in
/dev/shm and maps it; chunks then travel as references into it (one copy on each side, none
in the kernel). If the segment cannot be mapped (another user, another /dev/shm), that
connection and the later ones stay on the socket.

Zero-copy: ``get_into`` has each chunk body ``recv_into`` the caller's buffer (plain TCP:
one ``MSG_WAITALL`` ``recvmsg_into`` per frame, body and the next frame's header); ``get`` reads
each body with one ``recv(n, MSG_WAITALL)`` into a fresh ``bytes`` it returns as is (plain
TCP; TLS copies once out of the reader's buffer); ``put`` sends header and the caller's
buffer with one ``sendmsg``. Deadlines on plain TCP are SO_RCVTIMEO/SO_SNDTIMEO set to the
time left before every frame, so a blocking ``MSG_WAITALL`` read still ends in time.

Lookups: ``lookup`` asks a node that names LOOKUP in its WELCOME on a connection free now
(never waiting behind chunk transfers); otherwise it returns None and the caller uses gRPC.

This module holds the verbs (batching, retry on a stale pooled connection, errors mapped to
:class:`~kvtier.tiers.remote.node.NodeError`); one connection's framing, deadlines and shared
segment are :class:`~kvtier.tiers.remote.data_conn.DataConn`.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtier.memcopy import copy_into
from kvtier.protocol.frames import ERROR as FRAME_ERROR
from kvtier.protocol.frames import (
    OP_LOOKUP,
    ProtocolError,
    encode_get,
    encode_lookup,
    encode_put,
    encode_put_ref,
    parse_lookup_reply,
    parse_put_reply,
    parse_text,
)
from kvtier.protocol.socket_io import send_all
from kvtier.protocol.wire import placed_bytes
from kvtier.tiers.base import ABSENT, NODE_DOWN, Entry, FilledEntry, Miss, Probe
from kvtier.tiers.remote.data_conn import DataConn, Visit
from kvtier.tiers.remote.data_pool import DataConnPool
from kvtier.tiers.remote.errors import (
    NodeError,
    check_chunk,
    io_error,
    no_time_left,
    refused,
)

T = TypeVar("T")


class SocketDataPath(DataConnPool):
    """Thread-safe; see the module docstring."""

    # --- verbs ------------------------------------------------------------------------------------
    def get(self, keys: Sequence[bytes], deadline: float) -> list[bytes | Miss]:
        out: list[bytes | Miss] = []
        for a, b in self._cut.get_spans(len(keys)):
            batch = keys[a:b]
            results = self._retry(self._get, batch, None, deadline)
            self._cut.saw([len(r) for r in results if isinstance(r, bytes)])
            for key, r in zip(batch, results):
                if isinstance(r, str):
                    out.append(Miss(r))
                else:
                    assert isinstance(r, bytes)  # into=False: bodies come back as bytes
                    out.append(check_chunk(key, r))
        return out

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], deadline: float) -> list[int | Miss]:
        out: list[int | Miss] = []
        for a, b in self._cut.get_into_spans(outs):
            batch, views = keys[a:b], outs[a:b]
            results = self._retry(self._get, batch, views, deadline)
            self._cut.saw(results)
            for key, view, r in zip(batch, views, results):
                if isinstance(r, str):
                    out.append(Miss(r))
                else:
                    assert isinstance(r, int)  # into=True, references resolved
                    n = r
                    checked = check_chunk(key, view[:n])
                    out.append(n if not isinstance(checked, Miss) else checked)
        return out

    def get_visit(self, keys: Sequence[bytes], visit: Visit, deadline: float) -> list[int | Miss]:
        """Hand each chunk to ``visit(i, view)`` where it lies (in the shared segment: no copy
        on this side); ``view`` is read-only and valid only during the call. A chunk whose
        header does not name its key is a CORRUPT miss and never visited. Per key: the
        chunk's length, or the miss. A retry on a fresh connection (a stale pooled one) may
        visit an index again with the same chunk."""
        out: list[int | Miss] = []
        for base, end in self._cut.get_spans(len(keys)):
            batch = keys[base:end]
            bad: dict[int, Miss] = {}

            def checked(i: int, view: memoryview, base: int = base, batch: Sequence[bytes] = batch,
                        bad: dict[int, Miss] = bad) -> None:
                miss = check_chunk(batch[i], view)
                if isinstance(miss, Miss):
                    bad[i] = miss
                else:
                    visit(base + i, view)

            results = self._retry(self._get, batch, None, deadline, checked)
            self._cut.saw(results)
            for i, r in enumerate(results):
                if isinstance(r, str):
                    out.append(Miss(r))
                else:
                    assert isinstance(r, int)  # visited: lengths
                    out.append(bad.get(i, r))
        return out

    def _retry(self, op: Callable[..., T], *args: Any) -> T:
        """Run ``op``; when it found a pooled connection dead (the server closes connections
        idle for 10 minutes, or restarted), drop the idle pool and run it once more on a fresh
        connection (GET and PUT are idempotent)."""
        try:
            return op(*args)
        except _Stale:
            self.drop_idle()
            try:
                return op(*args)
            except _Stale:
                raise NodeError(NODE_DOWN, f"data path {self.host}:{self.port}: connection lost", down=False) from None

    def _get(self, keys: Sequence[bytes], targets: Sequence[memoryview] | None,
             deadline: float, visit: Visit | None = None) -> list[bytes | int | str]:
        conn = self._checkout_armed(deadline, "GET")
        ok = False
        try:
            conn.targets = targets
            send_all(conn.sock, encode_get(keys))
            read = conn.read_reply if not conn.tls else conn.collect_reply  # TLS: no MSG_WAITALL
            try:
                results, error = read(len(keys), targets, deadline, visit)
            except ValueError:  # a caller's buffer too small; the reply was drained
                ok = visit is None  # (a visitor's own ValueError leaves the reply half read)
                raise
            ok = True
            overflow, conn.overflow = conn.overflow, {}
        except (OSError, ProtocolError, ssl.SSLError) as exc:
            raise _failure(conn.reused, exc, f"data path {self.host}:{self.port} GET") from None
        finally:
            self._checkin(conn, ok)
        if error is not None:
            raise refused(error, f"data path {self.host}:{self.port} GET")
        if overflow and targets is not None:  # the reply was drained: the connection is fine
            i, n = next(iter(overflow.items()))
            raise ValueError(f"buffer of {targets[i].nbytes} bytes is too small for a {n}-byte chunk")
        return results

    def lookup(self, keys: Sequence[bytes], deadline: float) -> Probe | None:
        """How many leading ``keys`` the node holds and why the run stopped, as the gRPC
        ``Lookup`` answers (LOOKUP requests of at most ``max_batch_keys`` keys). None when the
        node does not serve LOOKUP (an older server) or no connection is free now: a probe
        never queues behind chunk transfers, the caller asks over gRPC instead."""
        hits, step = 0, self.limits.max_batch_keys
        for base in range(0, len(keys), step):
            batch = keys[base : base + step]
            reply = self._retry(self._lookup, batch, deadline)
            if reply is None:
                return None
            if reply[0] < len(batch):
                return Probe(hits + reply[0], reply[1] or ABSENT)
            hits += reply[0]
        return Probe(hits)

    def _lookup(self, keys: Sequence[bytes], deadline: float) -> tuple[int, str] | None:
        conn = self._checkout_now(deadline)
        if conn is None:
            return None
        ok = False
        try:
            if OP_LOOKUP not in conn.ops:
                ok = True
                return None
            if not conn.arm(deadline):
                ok = True  # nothing was sent: the connection is still in step
                raise no_time_left(f"data path {self.host}:{self.port} LOOKUP")
            send_all(conn.sock, encode_lookup(keys))
            frame = conn.read(deadline)
            ok = frame.type != FRAME_ERROR  # a refused LOOKUP is a protocol error: the server hangs up
            if not ok:
                raise refused((frame.header.count, parse_text(frame)), f"data path {self.host}:{self.port} LOOKUP")
            return parse_lookup_reply(frame, len(keys))
        except (OSError, ProtocolError, ssl.SSLError) as exc:
            ok = False
            raise _failure(conn.reused, exc, f"data path {self.host}:{self.port} LOOKUP") from None
        finally:
            self._checkin(conn, ok)

    def put(self, entries: Sequence[Entry | FilledEntry], deadline: float) -> list[bool]:
        """Store ``entries``, ``max_batch_keys`` per request (on shared memory, as many as its
        segment holds). A :class:`FilledEntry`'s chunk is
        written by its ``fill``: on shared memory straight into the segment, its reference sent
        at once (the server verifies and stores chunk i while chunk i+1 is filled); otherwise
        filled into fresh memory and sent inline."""
        out: list[bool] = []
        sizes = [e.length if isinstance(e, FilledEntry) else memoryview(e.data).nbytes for e in entries]
        for a, b in self._cut.put_spans(sizes):
            out += self._retry(self._put, entries[a:b], deadline)
        return out

    def _put(self, entries: Sequence[Entry | FilledEntry], deadline: float) -> list[bool]:
        conn = self._checkout_armed(deadline, "PUT")
        ok = False
        try:
            last = len(entries) - 1
            if conn.shm is not None:
                self._put_shm(conn, entries)
            else:
                parts: list[bytes | bytearray | memoryview] = []
                for i, e in enumerate(entries):  # one sendmsg for many frames; chunks never copied
                    e = e.materialize() if isinstance(e, FilledEntry) else e
                    parts += encode_put(e.key, memoryview(e.data).cast("B"), e.depth, e.parent, i < last)
                send_all(conn.sock, parts)
            frame = conn.read(deadline)
            ok = True
            if frame.type == FRAME_ERROR:
                raise refused((frame.header.count, parse_text(frame)), f"data path {self.host}:{self.port} PUT")
            return parse_put_reply(frame, len(entries))
        except (OSError, ProtocolError, ssl.SSLError) as exc:
            ok = False
            raise _failure(conn.reused, exc, f"data path {self.host}:{self.port} PUT") from None
        finally:
            self._checkin(conn, ok)

    @staticmethod
    def _put_shm(conn: DataConn, entries: Sequence[Entry | FilledEntry]) -> None:
        """Copy (or fill) each chunk into the segment and send its reference at once (the
        server verifies chunk i while chunk i+1 is copied); what does not fit goes inline."""
        assert conn.shm is not None
        offset, last = 0, len(entries) - 1
        for i, e in enumerate(entries):
            n = e.length if isinstance(e, FilledEntry) else memoryview(e.data).nbytes
            if offset + n <= conn.shm.nbytes:
                room = conn.shm[offset : offset + n]
                if isinstance(e, FilledEntry):
                    e.fill(room)
                else:
                    copy_into(room, memoryview(e.data).cast("B"))  # the GIL released meanwhile
                send_all(conn.sock, encode_put_ref(e.key, offset, n, e.depth, e.parent, i < last))
                offset += placed_bytes(n)
            else:
                data = e.materialize().data if isinstance(e, FilledEntry) else e.data
                send_all(conn.sock, encode_put(e.key, memoryview(data).cast("B"), e.depth, e.parent, i < last))


class _Stale(Exception):
    """A connection from the idle pool turned out closed by the peer."""


def _failure(reused: bool, exc: BaseException, what: str) -> Exception:
    """What a request's I/O failure means: a reused idle connection the peer had closed is
    stale (retried once on a fresh one); anything else is :func:`~kvtier.tiers.remote.errors.io_error`."""
    if reused and isinstance(exc, ConnectionError):
        return _Stale()
    return io_error(exc, what)


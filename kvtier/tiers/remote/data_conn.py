"""One data-port connection of the grpc tier's fast path: framing on the socket, deadlines,
and the shared-memory segment it may map.

:class:`DataConn` reads kvtier.protocol.frames frames (chunk bodies straight into the caller's
buffers, or into fresh ``bytes``; on plain TCP one ``MSG_WAITALL`` call per body, with the next
frame's header of a GET reply), bounds every socket call by the request's deadline
(SO_RCVTIMEO/SO_SNDTIMEO on plain TCP, ``settimeout`` under TLS), and maps the server's shared
segment when asked to (:mod:`kvtier.tiers.remote.shm_map` fetches and checks it).

Ownership and threads: a connection belongs to one request at a time (the pool in
``kvtier.tiers.remote.data_path`` hands it out and takes it back); nothing here locks. Failure:
``OSError``/``ssl.SSLError``/``ProtocolError`` propagate (the pool closes the connection and
maps them to a node error); ``ValueError`` when a caller's buffer is too small.
"""

from __future__ import annotations

import mmap
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import cast

from kvtier.memcopy import copy_into
from kvtier.protocol.frames import (
    ARENA,
    CHUNK,
    ERROR,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MISS,
    MORE,
    PARENT,
    SHM,
    SHM_READY,
    TYPE_NAMES,
    Frame,
    FrameReader,
    ProtocolError,
    ShmRef,
    WireLimits,
    encode_shm_mapped,
    encode_shm_open,
    parse_header,
    parse_ref,
    parse_shm_ready,
)
from kvtier.protocol.session import GetReplyCollector
from kvtier.protocol.socket_io import read_frame, send_all, set_kernel_timeouts
from kvtier.tiers.remote.shm_map import map_offer, release_arena

__all__ = ["DataConn", "DeadlinePassed"]


def _load_c_recv_chunks() -> Callable[..., tuple[int, int, float]] | None:
    """kvtier/_replyloop.c's loop over runs of CHUNK frames; None where it was not built (the
    Python loop then reads every frame: same results and errors, tests/test_replyloop_fuzz.py)."""
    try:
        from kvtier._replyloop import recv_chunks
    except ImportError:
        return None
    return cast(Callable[..., tuple[int, int, float]], recv_chunks)


_REARM_S = 0.01
_REPLIES = (CHUNK, MISS)
_FLAGS = MORE | PARENT | SHM | ARENA
_UNPACK = HEADER.unpack_from
C_RECV_CHUNKS = _load_c_recv_chunks()
# get_visit's consumer: (index, read-only view of chunk ``index``), the view valid for the call.
Visit = Callable[[int, memoryview], None]


class DeadlinePassed(TimeoutError):
    """:meth:`DataConn.set_deadline` found no time left (no socket call was made). Mid-request
    it is a timeout like any other; before a request was sent the caller maps it to a
    timeout that does not mark the node down."""


class DataConn:
    """One data connection: its socket, frame reader, deadlines and mapped segment. Used by
    one request at a time (the pool in ``kvtier.tiers.remote.data_path`` checks it out); socket and
    protocol errors propagate to the caller, which closes the connection."""

    def __init__(self, sock: socket.socket, limits: WireLimits) -> None:
        self.sock = sock
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.targets: Sequence[memoryview] | None = None  # get_into destinations, by index
        self.overflow: dict[int, int] = {}  # index -> length of a chunk too big for its target
        self._armed = 0.0  # seconds SO_RCVTIMEO/SO_SNDTIMEO hold now (plain TCP)
        # Frames of the current GET reply sure to follow the one being read, if that one is
        # a CHUNK or MISS (set by the caller); the header bytes of the next frame read ahead.
        self.following = 0
        self._head_got = 0
        self.reused = False  # taken from the idle pool (the server may have closed it meanwhile)
        self.ops: frozenset[str] = frozenset()  # optional requests its server named in WELCOME
        self.shm: memoryview | None = None  # this connection's shared segment, once mapped
        self._shm_map: mmap.mmap | None = None
        self.arena: memoryview | None = None  # the tenant's arena, read-only, where offered and mapped
        self._arena_map: mmap.mmap | None = None
        self.reader = FrameReader(limits, self._target)
        self._head = memoryview(bytearray(HEADER_SIZE))  # read_reply's frame headers
        self._small = bytearray(0)  # read_reply's bodies that are not chunks (grows)
        # Largest body read_reply accepts per frame type (parse_header's limits).
        self._max_body = {t: limits.max_body(t) for t in (CHUNK, MISS, ERROR)}

    def _target(self, header: object) -> memoryview | None:
        if self.targets is None or getattr(header, "type", None) != CHUNK:
            return None
        index = header.count  # type: ignore[attr-defined]
        if index >= len(self.targets) or self.targets[index].nbytes < header.length:  # type: ignore[attr-defined]
            self.overflow[index] = header.length  # type: ignore[attr-defined]
            return None  # the reader's own buffer takes it; the caller gets a ValueError
        return self.targets[index]

    def set_deadline(self, deadline: float) -> None:
        """Bound the next socket calls by ``deadline``. Plain TCP re-arms SO_RCVTIMEO/SNDTIMEO
        (two syscalls) only when a call started now could end before the deadline or more than
        _REARM_S after it: once per request, then every _REARM_S, rather than once per frame."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlinePassed("deadline passed")
        if self.tls:
            self.sock.settimeout(left)
            return
        if self._armed_until - deadline <= _REARM_S and self._armed_until >= deadline:
            return
        set_kernel_timeouts(self.sock, left)
        self._armed = left

    def arm(self, deadline: float) -> bool:
        """:meth:`set_deadline` before a request is sent: False (nothing armed) when the
        deadline has passed, for the caller to fail without blaming the node."""
        try:
            self.set_deadline(deadline)
        except DeadlinePassed:
            return False
        return True

    @property
    def _armed_until(self) -> float:
        """Latest moment a socket call started now could block until."""
        return time.monotonic() + self._armed

    def read(self, deadline: float) -> Frame:
        """The next frame. Plain TCP: each read asks for exactly what the current header or
        body still needs with MSG_WAITALL (one ``recv`` per 1 MiB body, not one per queued
        segment; the reader's buffer never spans two frames); with ``following`` frames of a
        GET reply after a CHUNK or MISS, the next header comes in the same ``recvmsg_into``.
        A chunk body with no target is one ``recv`` into fresh bytes, which become the result.
        SO_RCVTIMEO bounds each call (a short read loops)."""
        self.set_deadline(deadline)
        if self.tls:
            return read_frame(self.sock, self.reader)
        sock, reader, waitall = self.sock, self.reader, socket.MSG_WAITALL
        if self._head_got:  # (part of) this frame's header came with the previous body
            got, self._head_got = self._head_got, 0
            frame = reader.advance(got)
            if frame is not None:
                return frame
        while True:
            need = reader.need()
            if need > 4096 and self.targets is None:  # a chunk body (headers are 16 bytes)
                data = sock.recv(need, waitall)
                if not data:
                    raise ConnectionError("node closed the data connection")
                frames = reader.feed(data)
                if frames:
                    return frames[0]
                continue
            if self.following and reader.body_type in _REPLIES:
                n = sock.recvmsg_into([reader.buffer(), reader.next_header_buffer()], 0, waitall)[0]
                if n > need:
                    self._head_got = n - need
                    n = need
            else:
                n = sock.recv_into(reader.buffer(), 0, waitall)
            if n == 0:
                raise ConnectionError("node closed the data connection")
            frame = reader.advance(n)
            if frame is not None:
                return frame

    def read_reply(self, n: int, targets: Sequence[memoryview] | None, deadline: float,
                   visit: Visit | None = None) -> tuple[list[bytes | int | str], tuple[int, str] | None]:
        """The whole reply to a GET of ``n`` keys on plain TCP, with :meth:`read` and
        :class:`~kvtier.protocol.session.GetReplyCollector`'s checks and ProtocolError messages,
        in one loop with no per-frame objects: (``results``, ``error``). ``results[i]`` is chunk
        i as fresh ``bytes`` (``targets`` None), or its length once it is in ``targets[i]``, or
        the miss reason; shared-memory references are copied out as they come. ``error`` is the
        (code, message) of an ERROR that refused the request (``results`` is then empty).

        Reads: a body is one MSG_WAITALL call with the next frame's header in the same call
        (into fresh bytes: in Python the header is its own call), in C (:data:`C_RECV_CHUNKS`,
        no Python per frame) for runs of plain CHUNK frames without ``visit``. A target too
        small for its chunk, or for a shared-memory chunk, is noted (``overflow`` / a ValueError
        raised once the reply is drained); the connection stays usable. Every call is bounded by
        ``deadline`` (SO_RCVTIMEO; a short read loops).

        ``visit`` (with ``targets`` None): each chunk is handed to ``visit(i, view)`` where it
        lies, in the shared segment (no copy) or in fresh bytes, and ``results[i]`` is its
        length; the view is valid only during the call."""
        head, max_body = self._head, self._max_body
        results: list[bytes | int | str] = []
        value_error: ValueError | None = None
        have = 0  # bytes of this frame's header read with the previous body
        fast = C_RECV_CHUNKS if visit is None else None
        i = 0
        while i < n:
            if fast is not None:  # a run of plain CHUNK frames in C; it stops before any other
                i, have, self._armed = fast(self.sock.fileno(), head, have, i, n, max_body[CHUNK],
                                            targets, results, deadline, self._armed)
                if i == n:
                    break
            self.set_deadline(deadline)
            if have < HEADER_SIZE:
                self._fill(head[have:], deadline)
            have = 0
            magic, ftype, flags, count, length = _UNPACK(head)
            if magic != MAGIC or flags & ~_FLAGS or length > max_body.get(ftype, -1):
                parse_header(head, self.reader.limits)  # raises its precise error for these
            if ftype == ERROR and i == 0:
                return [], (count, self._text(self._body(length, False, deadline)[0], ftype))
            if ftype != CHUNK and ftype != MISS:
                raise ProtocolError(f"expected CHUNK or MISS, got {TYPE_NAMES[ftype]}")
            if count != i:
                raise ProtocolError(f"reply for index {count}, expected {i}")
            more = i + 1 < n
            if ftype == MISS:
                body, have = self._body(length, more, deadline)
                results.append(self._text(body, ftype))
            elif flags & SHM:
                body, have = self._body(length, more, deadline)
                ref = parse_ref(body, "CHUNK", bool(flags & ARENA))
                if visit is not None:
                    visit(i, self.referenced(ref))
                    results.append(ref.length)
                    i += 1
                    continue
                try:
                    results.append(self.resolve(ref, targets[i] if targets is not None else None))
                except ValueError as exc:  # the caller's buffer is too small: drain first
                    value_error = exc
                    results.append("error")
            elif flags & ARENA:
                raise ProtocolError("CHUNK with the ARENA flag but not SHM")
            elif visit is not None:
                visit(i, memoryview(self._recv_bytes(length, deadline)))
                results.append(length)
            elif targets is None:
                results.append(self._recv_bytes(length, deadline))
            else:
                target = targets[i] if i < len(targets) else None
                if target is not None and target.nbytes >= length:
                    have = self._recv_body(target[:length], more, deadline)
                else:  # drained into our own buffer; the caller raises ValueError
                    self.overflow[i] = length
                    have = self._body(length, more, deadline)[1]
                results.append(length)
            i += 1
        if value_error is not None:
            raise value_error
        return results, None

    def collect_reply(self, n: int, targets: Sequence[memoryview] | None, deadline: float,
                      visit: Visit | None = None) -> tuple[list[bytes | int | str], tuple[int, str] | None]:
        """A GET reply frame by frame through :meth:`read` (TLS: no MSG_WAITALL): what
        :meth:`read_reply` returns, and the same ValueError once the reply is drained."""
        collector = GetReplyCollector(n, into=targets is not None)
        results = collector.results
        value_error: ValueError | None = None
        while not collector.done:
            self.following = n - len(results) - 1  # after this one, if not an ERROR
            collector.accept(self.read(deadline))
            last = results[-1] if results else None
            i = len(results) - 1
            if visit is not None and isinstance(last, (ShmRef, bytes)):
                view = self.referenced(last) if isinstance(last, ShmRef) else memoryview(last)
                visit(i, view)
                results[i] = view.nbytes
            elif isinstance(last, ShmRef):  # copy it out now, while the server fills the next
                try:
                    results[i] = self.resolve(last, targets[i] if targets is not None else None)
                except ValueError as exc:  # the caller's buffer is too small: drain first
                    value_error, results[i] = exc, "error"
        if value_error is not None:
            raise value_error
        return cast(list[bytes | int | str], results), collector.error  # every ShmRef resolved above

    def _fill(self, view: memoryview, deadline: float) -> None:
        """Fill ``view`` (MSG_WAITALL; a short read re-arms the deadline and goes on)."""
        got, size = 0, view.nbytes
        while got < size:
            if got:
                self.set_deadline(deadline)
            k = self.sock.recv_into(view[got:], size - got, socket.MSG_WAITALL)
            if k == 0:
                raise ConnectionError("node closed the data connection")
            got += k

    def _recv_body(self, body: memoryview, more: bool, deadline: float) -> int:
        """Read ``body`` whole, and when ``more`` the next frame's header with it (one
        ``recvmsg_into``); returns how many bytes of that header came (0-16)."""
        if not more:
            if body.nbytes:
                self._fill(body, deadline)
            return 0
        k = self.sock.recvmsg_into([body, self._head], 0, socket.MSG_WAITALL)[0]
        if k == 0:
            raise ConnectionError("node closed the data connection")
        if k < body.nbytes:  # cut short (a signal, the timeout re-armed): the rest alone
            self.set_deadline(deadline)
            self._fill(body[k:], deadline)
            return 0
        return k - body.nbytes

    def _body(self, length: int, more: bool, deadline: float) -> tuple[memoryview, int]:
        """A body that is not a chunk for the caller, read into this connection's own buffer
        (valid until the next call), and how many bytes of the next header came with it."""
        if len(self._small) < length:
            self._small = bytearray(length)
        body = memoryview(self._small)[:length]
        return body, self._recv_body(body, more, deadline)

    def _recv_bytes(self, length: int, deadline: float) -> bytes:
        """A chunk body as fresh ``bytes``: one MSG_WAITALL ``recv`` (no copy after the
        kernel's); a short read is completed in a buffer and copied once."""
        data = self.sock.recv(length, socket.MSG_WAITALL)
        if len(data) == length:
            return data
        if not data:
            raise ConnectionError("node closed the data connection")
        buf = bytearray(length)
        buf[: len(data)] = data
        self.set_deadline(deadline)
        self._fill(memoryview(buf)[len(data) :], deadline)
        return bytes(buf)

    @staticmethod
    def _text(body: memoryview, ftype: int) -> str:
        try:
            return bytes(body).decode()
        except UnicodeDecodeError:
            raise ProtocolError(f"{TYPE_NAMES[ftype]} body is not UTF-8") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        self.shm = self.arena = None
        if self._shm_map is not None:
            try:
                self._shm_map.close()
            except BufferError:  # a caller still holds a view: the GC unmaps it later
                pass
        if self._arena_map is not None:
            release_arena(self._arena_map)  # shared by this process's connections to that arena
        self._shm_map = self._arena_map = None

    def open_shm(self, deadline: float) -> bool:
        """Ask for a shared segment and map it; False (socket only) when either side cannot."""
        send_all(self.sock, encode_shm_open())
        frame = self.read(deadline)
        if frame.type != SHM_READY:
            return False  # ERROR: the server has it off
        mapping, arena = map_offer(parse_shm_ready(frame), deadline)
        send_all(self.sock, encode_shm_mapped(mapping is not None, arena is not None))
        if mapping is None:
            return False
        self._shm_map, self.shm = mapping, memoryview(mapping)
        if arena is not None:
            self._arena_map, self.arena = arena, memoryview(arena)
        return True

    def referenced(self, ref: ShmRef) -> memoryview:
        """A read-only view of a referenced chunk in the segment or the arena, valid until
        this connection serves its next request (the server never reuses a region within one
        reply, and holds an arena slot it named until the next request arrives)."""
        mapped, what = (self.arena, "arena") if ref.arena else (self.shm, "segment")
        if mapped is None or not ref.within(mapped.nbytes):
            raise ProtocolError(f"reference {ref} outside the mapped {what}")
        return mapped[ref.offset : ref.offset + ref.length].toreadonly()

    def resolve(self, ref: ShmRef, target: memoryview | None) -> bytes | int:
        """Copy a referenced chunk out of the segment (before the connection is reused)."""
        src = self.referenced(ref)
        if target is None:
            return bytes(src)
        if target.nbytes < ref.length:
            raise ValueError(f"buffer of {target.nbytes} bytes is too small for a {ref.length}-byte chunk")
        copy_into(target[: ref.length], src)  # the GIL released: other threads run meanwhile
        return ref.length


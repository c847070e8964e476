"""The bulk data path's framing, sans-I/O: bytes in, frames out; requests in, buffers out.

kvtier-server moves chunk bytes over gRPC (portable) and over this protocol on its data port
(fast: length-prefixed frames on a plain or TLS socket, read with ``recv_into`` straight into
their destination). Nothing here touches a socket, so the same code runs over sockets and
over the in-memory pairs of the tests and fuzzers.

Frame = 16-byte header + body::

    off size  field
      0   2   magic b"KW"
      2   1   type (HELLO, WELCOME, ERROR, GET, CHUNK, MISS, PUT, PUT_REPLY)
      3   1   flags (MORE = 1: another PUT of the same batch follows; PARENT = 2; SHM = 4)
      4   4   count (u32: meaning per type, below)
      8   8   body length (u64)

Conversation: the client sends HELLO (count = protocol version, body = bearer token) and gets
WELCOME (body = JSON: tenant, limits) or ERROR (count = gRPC status code, body = message) and a
close. Then any number of requests, one at a time per connection:

- GET (count = n, body = n 32-byte keys) -> n frames in key order: CHUNK (count = index, body =
  the chunk) or MISS (count = index, body = reason), or one ERROR for a refused request.
- PUT (count = depth, flags MORE/PARENT, body = key ‖ [parent] ‖ chunk), repeated with MORE
  set on all but the batch's last -> PUT_REPLY (count = n, body = n bytes 1/0 stored) or ERROR.

Shared memory (same host): SHM_OPEN -> SHM_READY (body = JSON ``socket``, ``ticket``, ``size``
of a sealed memfd the server made for this connection) -> the client connects to the abstract
Unix socket ``"\\0" + socket``, sends the ticket, receives the descriptor (SCM_RIGHTS), maps
it and answers SHM_MAPPED (count = 1, or 0 when it could not); no segment ever has a name.
Then a chunk may travel as a reference: a CHUNK or PUT with flag SHM carries ``offset ‖
length`` (u64 each) in place of the chunk bytes. Each request uses the segment from offset 0
(one request at a time per connection); a chunk that does not fit goes inline.

Before HELLO a server accepts only HELLO-sized frames (:meth:`WireLimits.handshake`).

Ownership: a frame's ``body`` is a view into the reader's buffer (valid until the next frame),
into the caller's target buffer (see ``body_target``) or, from :meth:`FrameReader.feed`, into
the fed bytes when a whole body arrived in one piece (then :meth:`Frame.body_bytes` is free).
Every decoding problem raises :class:`ProtocolError`; nothing else escapes a parser.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import KEY_BYTES

MAGIC = b"KW"
VERSION = 1
HEADER = struct.Struct("<2sBBIQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 16

HELLO, WELCOME, ERROR, GET, CHUNK, MISS, PUT, PUT_REPLY, SHM_OPEN, SHM_READY, SHM_MAPPED = range(1, 12)
TYPE_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", ERROR: "ERROR", GET: "GET", CHUNK: "CHUNK",
              MISS: "MISS", PUT: "PUT", PUT_REPLY: "PUT_REPLY", SHM_OPEN: "SHM_OPEN",
              SHM_READY: "SHM_READY", SHM_MAPPED: "SHM_MAPPED"}
MORE = 1
PARENT = 2
SHM = 4
_REF = struct.Struct("<QQ")
_SMALL = 64 << 10  # bound of control bodies (HELLO, WELCOME, ERROR, MISS)
HELLO_MAX = 4096  # a bearer token is at most 4096 characters (kvtier.server.auth)


class ProtocolError(Exception):
    """The peer sent something this protocol does not allow; the connection is unusable."""


@dataclass(frozen=True)
class WireLimits:
    max_chunk_bytes: int = 32 << 20
    max_batch_keys: int = 4096
    max_control_bytes: int = _SMALL

    @classmethod
    def handshake(cls) -> WireLimits:
        """Before authentication: no chunk, no keys, control bodies (HELLO) up to HELLO_MAX."""
        return cls(0, 0, HELLO_MAX)

    def max_body(self, ftype: int) -> int:
        if ftype in (CHUNK, PUT):
            return self.max_chunk_bytes + 2 * KEY_BYTES
        if ftype == GET:
            return self.max_batch_keys * KEY_BYTES
        if ftype == PUT_REPLY:
            return self.max_batch_keys
        return self.max_control_bytes


@dataclass(frozen=True)
class FrameHeader:
    type: int
    flags: int
    count: int
    length: int


def encode_header(ftype: int, flags: int, count: int, length: int) -> bytes:
    return HEADER.pack(MAGIC, ftype, flags, count, length)


def parse_header(data: bytes | bytearray | memoryview, limits: WireLimits) -> FrameHeader:
    if len(data) != HEADER_SIZE:
        raise ProtocolError(f"frame header is {HEADER_SIZE} bytes, got {len(data)}")
    magic, ftype, flags, count, length = HEADER.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad frame magic {bytes(magic)!r}")
    if ftype not in TYPE_NAMES:
        raise ProtocolError(f"unknown frame type {ftype}")
    if flags & ~(MORE | PARENT | SHM):
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if length > limits.max_body(ftype):
        raise ProtocolError(f"{TYPE_NAMES[ftype]} body of {length} bytes exceeds {limits.max_body(ftype)}")
    return FrameHeader(ftype, flags, count, length)


@dataclass(frozen=True)
class Frame:
    header: FrameHeader
    body: memoryview

    @property
    def type(self) -> int:
        return self.header.type

    def body_bytes(self) -> bytes:
        """The body as ``bytes``; no copy when it is a whole ``bytes`` object already."""
        obj = self.body.obj
        if isinstance(obj, bytes) and len(obj) == self.body.nbytes:
            return obj
        return bytes(self.body)


BodyTarget = Callable[[FrameHeader], memoryview | None]


class FrameReader:
    """Incremental frame decoder with caller-chosen destinations.

    I/O loop (zero-copy): ``buf = reader.buffer(); n = sock.recv_into(buf); frame =
    reader.advance(n)`` until a frame comes out. ``buffer()`` never spans two frames, so a
    read never takes bytes of the next frame. ``body_target(header)`` (optional) may return a
    buffer of at least ``header.length`` bytes to receive that frame's body (e.g. the caller's
    ``get_into`` destination); None means the reader's own reusable buffer.
    """

    def __init__(self, limits: WireLimits, body_target: BodyTarget | None = None) -> None:
        self.limits = limits
        self.body_target = body_target
        self._head = bytearray(HEADER_SIZE)
        self._own = bytearray(0)
        self._got = 0
        self._header: FrameHeader | None = None
        self._body: memoryview | None = None

    def need(self) -> int:
        """Bytes still missing for the current header or body (always >= 1)."""
        if self._header is None:
            return HEADER_SIZE - self._got
        return self._header.length - self._got

    def buffer(self) -> memoryview:
        if self._header is None:
            return memoryview(self._head)[self._got :]
        assert self._body is not None
        return self._body[self._got :]

    def advance(self, n: int) -> Frame | None:
        """``n`` bytes were written into :meth:`buffer`; the completed frame, if any."""
        if n <= 0 or n > self.need():
            raise ValueError(f"advance({n}) with {self.need()} bytes needed")
        self._got += n
        if self._header is None:
            if self._got < HEADER_SIZE:
                return None
            header = parse_header(self._head, self.limits)
            self._header, self._got = header, 0
            self._body = self._body_buffer(header)
            if header.length:
                return None
        if self._got < self._header.length:
            return None
        return self._finish(self._body)  # type: ignore[arg-type]

    def _body_buffer(self, header: FrameHeader) -> memoryview:
        target = self.body_target(header) if self.body_target is not None else None
        if target is not None:
            if target.nbytes < header.length:
                raise ValueError(f"body target of {target.nbytes} bytes for a {header.length}-byte body")
            return target[: header.length]
        if len(self._own) < header.length:
            # Doubling amortises growth, never past what the largest frame may need.
            self._own = bytearray(max(header.length, min(2 * len(self._own), self.limits.max_body(PUT))))
        return memoryview(self._own)[: header.length]

    def _finish(self, body: memoryview) -> Frame:
        assert self._header is not None
        frame = Frame(self._header, body)
        self._header, self._body, self._got = None, None, 0
        return frame

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Copying path for in-memory use: every frame completed by ``data``, each body its own
        (a body that lies whole inside ``bytes`` data is not copied: it views ``data``)."""
        view = memoryview(data).cast("B")
        frames: list[Frame] = []
        pos = 0
        while pos < len(view):
            if (self._header is not None and self._got == 0 and isinstance(data, bytes)
                    and len(view) - pos >= self._header.length and self._body is not None
                    and self._body.obj is self._own):
                self._body = view[pos : pos + self._header.length]
                pos += self._header.length
                frames.append(self._finish(self._body))
                continue
            buf = self.buffer()
            n = min(len(buf), len(view) - pos)
            buf[:n] = view[pos : pos + n]
            pos += n
            frame = self.advance(n)
            if frame is not None:
                if frame.body.obj is self._own:  # the next frame reuses that buffer: detach
                    frame = Frame(frame.header, memoryview(bytes(frame.body)))
                frames.append(frame)
        return frames


# --- encoders: each returns the buffers to send, in order (scatter/gather friendly) ------------
Buffers = list[bytes | bytearray | memoryview]


def encode_hello(token: str) -> Buffers:
    body = token.encode()
    return [encode_header(HELLO, 0, VERSION, len(body)), body]


def encode_welcome(info: dict[str, Any]) -> Buffers:
    body = json.dumps(info).encode()
    return [encode_header(WELCOME, 0, 0, len(body)), body]


def encode_error(code: int, message: str) -> Buffers:
    body = message.encode()[:_SMALL]
    return [encode_header(ERROR, 0, code, len(body)), body]


def encode_get(keys: Sequence[bytes]) -> Buffers:
    body = b"".join(keys)
    return [encode_header(GET, 0, len(keys), len(body)), body]


def encode_chunk(index: int, chunk: bytes | bytearray | memoryview) -> Buffers:
    return [encode_header(CHUNK, 0, index, len(chunk)), chunk]


def encode_chunk_ref(index: int, offset: int, length: int) -> Buffers:
    """Chunk ``index`` lies at ``offset`` in the connection's shared segment."""
    return [encode_header(CHUNK, SHM, index, _REF.size) + _REF.pack(offset, length)]


def encode_shm_open() -> Buffers:
    return [encode_header(SHM_OPEN, 0, 0, 0)]


def encode_shm_ready(offer: ShmOffer) -> Buffers:
    body = json.dumps({"socket": offer.socket, "ticket": offer.ticket, "size": offer.size}).encode()
    return [encode_header(SHM_READY, 0, 0, len(body)), body]


def encode_shm_mapped(ok: bool) -> Buffers:
    return [encode_header(SHM_MAPPED, 0, 1 if ok else 0, 0)]


def encode_miss(index: int, reason: str) -> Buffers:
    body = reason.encode()
    return [encode_header(MISS, 0, index, len(body)), body]


def encode_put(key: bytes, chunk: bytes | bytearray | memoryview, depth: int = 0, parent: bytes = b"",
               more: bool = False) -> Buffers:
    flags = (MORE if more else 0) | (PARENT if parent else 0)
    head = key + parent
    return [encode_header(PUT, flags, depth, len(head) + len(chunk)) + head, chunk]


def encode_put_ref(key: bytes, offset: int, length: int, depth: int = 0, parent: bytes = b"",
                   more: bool = False) -> Buffers:
    """A PUT whose chunk the client wrote at ``offset`` in the connection's shared segment."""
    flags = (MORE if more else 0) | (PARENT if parent else 0) | SHM
    body = key + parent + _REF.pack(offset, length)
    return [encode_header(PUT, flags, depth, len(body)) + body]


def encode_put_reply(stored: Sequence[bool]) -> Buffers:
    body = bytes(bytearray(1 if s else 0 for s in stored))
    return [encode_header(PUT_REPLY, 0, len(stored), len(body)), body]


# --- body parsers --------------------------------------------------------------------------------
def expect_type(frame: Frame, *types: int) -> None:
    if frame.type not in types:
        want = " or ".join(TYPE_NAMES[t] for t in types)
        raise ProtocolError(f"expected {want}, got {TYPE_NAMES.get(frame.type, frame.type)}")


def parse_hello(frame: Frame) -> str:
    expect_type(frame, HELLO)
    if frame.header.count != VERSION:
        raise ProtocolError(f"protocol version {frame.header.count}; this server speaks {VERSION}")
    try:
        return bytes(frame.body).decode()
    except UnicodeDecodeError:
        raise ProtocolError("HELLO token is not UTF-8") from None


def parse_text(frame: Frame) -> str:
    try:
        return bytes(frame.body).decode()
    except UnicodeDecodeError:
        raise ProtocolError(f"{TYPE_NAMES[frame.type]} body is not UTF-8") from None


def parse_welcome(frame: Frame) -> dict[str, Any]:
    expect_type(frame, WELCOME)
    try:
        info = json.loads(bytes(frame.body))
    except ValueError:
        raise ProtocolError("WELCOME body is not JSON") from None
    if not isinstance(info, dict):
        raise ProtocolError("WELCOME body is not a JSON object")
    return info


def parse_get(frame: Frame, limits: WireLimits) -> list[bytes]:
    expect_type(frame, GET)
    n = frame.header.count
    if n > limits.max_batch_keys or frame.body.nbytes != n * KEY_BYTES:
        raise ProtocolError(f"GET of {n} keys with a {frame.body.nbytes}-byte body")
    body = bytes(frame.body)
    return [body[i : i + KEY_BYTES] for i in range(0, len(body), KEY_BYTES)]


@dataclass(frozen=True)
class ShmRef:
    """``length`` bytes at ``offset`` of the connection's shared segment (unchecked: the
    receiver checks the range against the segment it mapped)."""

    offset: int
    length: int

    def within(self, size: int) -> bool:
        return self.offset + self.length <= size


@dataclass(frozen=True)
class PutItem:
    key: bytes
    parent: bytes
    depth: int
    chunk: memoryview | ShmRef
    more: bool


def parse_ref(body: memoryview, what: str) -> ShmRef:
    if body.nbytes != _REF.size:
        raise ProtocolError(f"{what} shared-memory reference of {body.nbytes} bytes, expected {_REF.size}")
    return ShmRef(*_REF.unpack(body))


def parse_put(frame: Frame) -> PutItem:
    expect_type(frame, PUT)
    head = 2 * KEY_BYTES if frame.header.flags & PARENT else KEY_BYTES
    if frame.body.nbytes < head:
        raise ProtocolError(f"PUT body of {frame.body.nbytes} bytes has no room for its keys")
    body = frame.body
    parent = bytes(body[KEY_BYTES:head]) if head > KEY_BYTES else b""
    chunk: memoryview | ShmRef = parse_ref(body[head:], "PUT") if frame.header.flags & SHM else body[head:]
    return PutItem(bytes(body[:KEY_BYTES]), parent, frame.header.count, chunk, bool(frame.header.flags & MORE))


@dataclass(frozen=True)
class ShmOffer:
    """SHM_READY: where to fetch the segment's descriptor, with which ticket, and its size."""

    socket: str  # abstract Unix socket name, without the leading NUL
    ticket: str
    size: int


def parse_shm_ready(frame: Frame) -> ShmOffer:
    expect_type(frame, SHM_READY)
    info = parse_welcome(Frame(FrameHeader(WELCOME, 0, 0, frame.header.length), frame.body))
    sock, ticket, size = info.get("socket"), info.get("ticket"), info.get("size")
    if (not isinstance(sock, str) or not sock or not isinstance(ticket, str) or not ticket
            or not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        raise ProtocolError("SHM_READY needs a socket, a ticket and a positive size")
    return ShmOffer(sock, ticket, size)


def parse_put_reply(frame: Frame, expected: int) -> list[bool]:
    expect_type(frame, PUT_REPLY)
    if frame.header.count != expected or frame.body.nbytes != expected:
        raise ProtocolError(f"PUT_REPLY for {frame.header.count} items, expected {expected}")
    return [b != 0 for b in frame.body]

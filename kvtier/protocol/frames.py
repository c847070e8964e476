"""The bulk data path's framing, sans-I/O: bytes in, frames out; requests in, buffers out.

kvtier-server moves chunk bytes over gRPC (portable) and over this protocol on its data port
(fast: length-prefixed frames on a plain or TLS socket, read with ``recv_into`` straight into
their destination). Nothing here touches a socket, so the same code runs over sockets and
over the in-memory pairs of the tests and fuzzers.

Frame = 16-byte header + body::

    off size  field
      0   2   magic b"KW"
      2   1   type (HELLO, WELCOME, ERROR, GET, CHUNK, MISS, PUT, PUT_REPLY, LOOKUP, LOOKUP_REPLY, SHM_*)
      3   1   flags (MORE = 1: another PUT of the same batch follows; PARENT = 2; SHM = 4;
                     ARENA = 8, with SHM on a CHUNK)
      4   4   count (u32: meaning per type, below)
      8   8   body length (u64)

Conversation: the client sends HELLO (count = protocol version, body = bearer token) and gets
WELCOME (body = JSON: tenant, limits, ``ops``: the optional requests it serves, below) or ERROR
(count = gRPC status code, body = message) and a close. Then any number of requests, one at a
time per connection:

- GET (count = n, body = n 32-byte keys) -> n frames in key order: CHUNK (count = index, body =
  the chunk) or MISS (count = index, body = reason), or one ERROR for a refused request.
- PUT (count = depth, flags MORE/PARENT, body = key ‖ [parent] ‖ chunk), repeated with MORE
  set on all but the batch's last -> PUT_REPLY (count = n, body = n bytes 1/0 stored) or ERROR.
- LOOKUP (count = n, body = n 32-byte keys; only to a server whose WELCOME ``ops`` has
  ``"lookup"``) -> LOOKUP_REPLY (count = how many leading keys the tenant's store holds, body
  = why the run stopped, UTF-8, as the gRPC ``Lookup``'s ``reason``). Limits as GET's.

Shared memory (same host): SHM_OPEN -> SHM_READY (body = JSON ``socket``, ``ticket``, ``size``
of a sealed memfd the server made for this connection) -> the client connects to the abstract
Unix socket ``"\\0" + socket``, sends the ticket, receives the descriptor (SCM_RIGHTS), maps
it and answers SHM_MAPPED (count = 1, or 0 when it could not); no segment ever has a name.
Then a chunk may travel as a reference: a CHUNK or PUT with flag SHM carries ``offset ‖
length`` (u64 each) in place of the chunk bytes. Each request uses the segment from offset 0
(one request at a time per connection); a chunk that does not fit goes inline.
Where SHM_READY's JSON also names ``arena`` (a size), a second descriptor comes with the
segment's: the tenant's RAM arena, read-only. A client that mapped it too answers SHM_MAPPED
with count = 3 (MAPPED_SEGMENT | MAPPED_ARENA); GET replies may then carry CHUNKs with flags
SHM | ARENA, whose reference is into the arena: the server holds that slot (never reused)
until the connection's next request arrives, so the client reads it until it sends one.

Before HELLO a server accepts only HELLO-sized frames (:meth:`WireLimits.handshake`).

The fixed part (types, flags, header, limits, :class:`Frame`) is :mod:`kvtier.protocol.wire`,
the encoders and body parsers :mod:`kvtier.protocol.messages`; this module holds the reader and
re-exports both.

Ownership: a frame's ``body`` is a view into the reader's buffer (valid until the next frame),
into the caller's target buffer (see ``body_target``) or, from :meth:`FrameReader.feed`, into
the fed bytes when a whole body arrived in one piece (then :meth:`Frame.body_bytes` is free).
Every decoding problem raises :class:`ProtocolError`; nothing else escapes a parser.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.protocol.messages import (
    Buffers,
    LookupKeys,
    PutItem,
    ShmOffer,
    ShmRef,
    encode_chunk,
    encode_chunk_ref,
    encode_error,
    encode_get,
    encode_hello,
    encode_lookup,
    encode_lookup_reply,
    encode_miss,
    encode_put,
    encode_put_ref,
    encode_put_reply,
    encode_shm_mapped,
    encode_shm_open,
    encode_shm_ready,
    encode_welcome,
    expect_type,
    parse_get,
    parse_hello,
    parse_lookup,
    parse_lookup_reply,
    parse_put,
    parse_put_reply,
    parse_ref,
    parse_shm_ready,
    parse_text,
    parse_welcome,
    split_put,
    welcome_ops,
)
from kvtier.protocol.wire import (
    ARENA,
    CHUNK,
    ERROR,
    GET,
    HEADER,
    HEADER_SIZE,
    HELLO,
    HELLO_MAX,
    LOOKUP,
    LOOKUP_REPLY,
    MAGIC,
    MAPPED_ARENA,
    MAPPED_SEGMENT,
    MISS,
    MORE,
    OP_LOOKUP,
    PARENT,
    PUT,
    PUT_REPLY,
    SHM,
    SHM_MAPPED,
    SHM_OPEN,
    SHM_READY,
    TYPE_NAMES,
    VERSION,
    WELCOME,
    Frame,
    FrameHeader,
    ProtocolError,
    WireLimits,
    encode_header,
    parse_header,
)

__all__ = [
    "ARENA", "MAPPED_ARENA", "MAPPED_SEGMENT", "CHUNK", "ERROR", "GET", "HEADER", "HEADER_SIZE", "HELLO", "HELLO_MAX", "LOOKUP", "LOOKUP_REPLY", "MAGIC",
    "MISS", "MORE", "OP_LOOKUP", "PARENT", "PUT", "PUT_REPLY", "SHM", "SHM_MAPPED", "SHM_OPEN", "SHM_READY",
    "TYPE_NAMES", "VERSION", "WELCOME", "BodyTarget", "Buffers", "Frame", "FrameHeader", "FrameReader",
    "LookupKeys", "ProtocolError", "PutItem", "ShmOffer", "ShmRef", "WireLimits", "encode_chunk",
    "encode_chunk_ref", "encode_error", "encode_get", "encode_header", "encode_hello", "encode_lookup",
    "encode_lookup_reply", "encode_miss", "encode_put", "encode_put_ref", "encode_put_reply",
    "encode_shm_mapped", "encode_shm_open", "encode_shm_ready", "encode_welcome", "expect_type",
    "parse_get", "parse_header", "parse_hello", "parse_lookup", "parse_lookup_reply", "parse_put",
    "parse_put_reply", "parse_ref", "parse_shm_ready", "parse_text", "parse_welcome", "split_put", "welcome_ops",
]

BodyTarget = Callable[[FrameHeader], memoryview | tuple[memoryview, memoryview] | None]


class FrameReader:
    """Incremental frame decoder with caller-chosen destinations.

    I/O loop (zero-copy): ``buf = reader.buffer(); n = sock.recv_into(buf); frame =
    reader.advance(n)`` until a frame comes out. ``buffer()`` never spans two frames, so a
    read never takes bytes of the next frame. ``body_target(header)`` (optional) may return a
    buffer of at least ``header.length`` bytes to receive that frame's body (e.g. the caller's
    ``get_into`` destination), or two buffers whose sizes add up to ``header.length`` exactly:
    the body's first part lands in the first, the rest in the second (the frame's ``body``
    and ``tail``: a server receives a PUT's keys in one and its chunk in a store slot); None
    means the reader's own reusable buffer.
    """

    def __init__(self, limits: WireLimits, body_target: BodyTarget | None = None) -> None:
        self.limits = limits
        self.body_target = body_target
        self._head = bytearray(HEADER_SIZE)
        self._own = bytearray(0)
        self._got = 0
        self._header: FrameHeader | None = None
        self._body: memoryview | None = None
        self._tail: memoryview | None = None  # the second part of a split body target

    def need(self) -> int:
        """Bytes still missing for the current header or body (always >= 1)."""
        if self._header is None:
            return HEADER_SIZE - self._got
        return self._header.length - self._got

    @property
    def body_type(self) -> int | None:
        """The type of the frame whose body is being read (None between frames)."""
        return self._header.type if self._header is not None else None

    def next_header_buffer(self) -> memoryview:
        """While a frame's body is being read: where the following frame's header goes (what
        :meth:`buffer` returns once this frame completes). A caller that knows another frame
        follows may fill it in the same read as the rest of this body (``recvmsg_into``), end
        this frame with :meth:`advance`, then pass the header bytes it got to
        :meth:`advance` (which checks them as it checks any header)."""
        if self._header is None:
            raise ValueError("no frame body is being read")
        return memoryview(self._head)

    def split_buffers(self) -> list[memoryview] | None:
        """While the first part of a split body is being read: what it still needs and the
        whole second part, in order (a reader with ``recvmsg_into`` fills both in one call,
        e.g. a PUT's keys and its chunk); None otherwise (read :meth:`buffer`)."""
        if self._tail is None or self._body is None or self._got >= self._body.nbytes:
            return None
        return [self._body[self._got :], self._tail]

    def buffer(self) -> memoryview:
        if self._header is None:
            return memoryview(self._head)[self._got :]
        assert self._body is not None
        if self._tail is not None and self._got >= self._body.nbytes:
            return self._tail[self._got - self._body.nbytes :]
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
        if isinstance(target, tuple):
            head, tail = target
            if head.nbytes + tail.nbytes != header.length:
                raise ValueError(f"split body target of {head.nbytes} + {tail.nbytes} bytes for a "
                                 f"{header.length}-byte body")
            self._tail = tail
            return head
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
        frame = Frame(self._header, body, self._tail)
        self._header, self._body, self._tail, self._got = None, None, None, 0
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
                    and self._body.obj is self._own and self._tail is None):
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

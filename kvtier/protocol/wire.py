"""kvtier.protocol.frames's fixed part: frame types and flags, the 16-byte header, limits, and
the decoded :class:`Frame` (the format itself is described in :mod:`kvtier.protocol.frames`).
Sans-I/O; every decoding problem raises :class:`ProtocolError`."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvtier.keys import KEY_BYTES

MAGIC = b"KW"
VERSION = 1
HEADER = struct.Struct("<2sBBIQ")
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 16

(HELLO, WELCOME, ERROR, GET, CHUNK, MISS, PUT, PUT_REPLY, SHM_OPEN, SHM_READY, SHM_MAPPED, LOOKUP,
 LOOKUP_REPLY) = range(1, 14)
TYPE_NAMES = {HELLO: "HELLO", WELCOME: "WELCOME", ERROR: "ERROR", GET: "GET", CHUNK: "CHUNK",
              MISS: "MISS", PUT: "PUT", PUT_REPLY: "PUT_REPLY", SHM_OPEN: "SHM_OPEN",
              SHM_READY: "SHM_READY", SHM_MAPPED: "SHM_MAPPED", LOOKUP: "LOOKUP", LOOKUP_REPLY: "LOOKUP_REPLY"}
# Optional requests a server names in WELCOME's "ops"; a client sends one only to a server that
# named it (a server without it would take the frame type for a protocol error).
OP_LOOKUP = "lookup"
MORE = 1
PARENT = 2
SHM = 4
ARENA = 8  # with SHM, on a CHUNK only: the reference is into the tenant's arena, not the segment
# SHM_MAPPED's count: what the client mapped (bits)
MAPPED_SEGMENT = 1
MAPPED_ARENA = 2
_REF = struct.Struct("<QQ")
REF_SIZE = _REF.size  # a shared-memory reference in a frame body: offset u64 || length u64
SEGMENT_ALIGN = 64  # a chunk placed in a shared segment starts on a cache-line boundary


def placed_bytes(nbytes: int) -> int:
    """Bytes a chunk of ``nbytes`` takes in a shared segment, its alignment padding included
    (both sides place a request's chunks one after another from the segment's start)."""
    return (nbytes + SEGMENT_ALIGN - 1) & ~(SEGMENT_ALIGN - 1)

_SMALL = 64 << 10  # bound of control bodies (HELLO, WELCOME, ERROR, MISS, LOOKUP_REPLY)
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
        if ftype in (GET, LOOKUP):
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
    if flags & ~(MORE | PARENT | SHM | ARENA):
        raise ProtocolError(f"unknown frame flags {flags:#x}")
    if length > limits.max_body(ftype):
        raise ProtocolError(f"{TYPE_NAMES[ftype]} body of {length} bytes exceeds {limits.max_body(ftype)}")
    return FrameHeader(ftype, flags, count, length)


@dataclass(frozen=True)
class Frame:
    """A decoded frame. ``tail`` is set only when the reader's caller split the body (see
    ``FrameReader``'s ``body_target``): ``body`` is then its first part and ``tail`` the rest."""

    header: FrameHeader
    body: memoryview
    tail: memoryview | None = None

    @property
    def type(self) -> int:
        return self.header.type

    def body_bytes(self) -> bytes:
        """The body as ``bytes``; no copy when it is a whole ``bytes`` object already."""
        obj = self.body.obj
        if isinstance(obj, bytes) and len(obj) == self.body.nbytes:
            return obj
        return bytes(self.body)

"""kvtier.protocol.frames's messages, sans-I/O: an encoder per frame type (each returns the
buffers to send, in order) and a parser per body (each raises :class:`ProtocolError` for a
body the protocol does not allow). The format is described in :mod:`kvtier.protocol.frames`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.keys import KEY_BYTES
from kvtier.protocol.wire import (
    _REF,
    _SMALL,
    ARENA,
    CHUNK,
    ERROR,
    GET,
    HELLO,
    LOOKUP,
    LOOKUP_REPLY,
    MAPPED_ARENA,
    MAPPED_SEGMENT,
    MISS,
    MORE,
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
    ProtocolError,
    WireLimits,
    encode_header,
)

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


def encode_lookup(keys: Sequence[bytes]) -> Buffers:
    body = b"".join(keys)
    return [encode_header(LOOKUP, 0, len(keys), len(body)), body]


def encode_lookup_reply(hits: int, reason: str) -> Buffers:
    """``hits`` leading keys of the LOOKUP are present; ``reason``: why the run stopped."""
    body = reason.encode()[:_SMALL]
    return [encode_header(LOOKUP_REPLY, 0, hits, len(body)), body]


def encode_chunk(index: int, chunk: bytes | bytearray | memoryview) -> Buffers:
    return [encode_header(CHUNK, 0, index, len(chunk)), chunk]


def encode_chunk_ref(index: int, offset: int, length: int, arena: bool = False) -> Buffers:
    """Chunk ``index`` lies at ``offset`` in the connection's shared segment, or with ``arena``
    in the tenant's arena the client mapped read-only."""
    return [encode_header(CHUNK, SHM | ARENA if arena else SHM, index, _REF.size) + _REF.pack(offset, length)]


def encode_shm_open() -> Buffers:
    return [encode_header(SHM_OPEN, 0, 0, 0)]


def encode_shm_ready(offer: ShmOffer) -> Buffers:
    info: dict[str, Any] = {"socket": offer.socket, "ticket": offer.ticket, "size": offer.size}
    if offer.arena_size:
        info["arena"] = offer.arena_size
    body = json.dumps(info).encode()
    return [encode_header(SHM_READY, 0, 0, len(body)), body]


def encode_shm_mapped(segment: bool, arena: bool = False) -> Buffers:
    """What the client mapped: the segment, and the arena (only with the segment)."""
    count = (MAPPED_SEGMENT | (MAPPED_ARENA if arena else 0)) if segment else 0
    return [encode_header(SHM_MAPPED, 0, count, 0)]


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
    return _json_object(frame, "WELCOME")


def _json_object(frame: Frame, what: str) -> dict[str, Any]:
    """The frame's body as a JSON object. RecursionError too is the peer's doing: a 64 KiB
    control body holds JSON nested deeper than the parser's stack."""
    try:
        info = json.loads(bytes(frame.body))
    except (ValueError, RecursionError):
        raise ProtocolError(f"{what} body is not JSON") from None
    if not isinstance(info, dict):
        raise ProtocolError(f"{what} body is not a JSON object")
    return info


def welcome_ops(info: dict[str, Any]) -> frozenset[str]:
    """The optional requests a WELCOME names (``ops``; none when absent: an older server)."""
    ops = info.get("ops", [])
    if not isinstance(ops, list) or not all(isinstance(op, str) for op in ops):
        raise ProtocolError("WELCOME ops is not a list of strings")
    return frozenset(ops)


def _parse_keys(frame: Frame, limits: WireLimits) -> list[bytes]:
    n = frame.header.count
    if n > limits.max_batch_keys or frame.body.nbytes != n * KEY_BYTES:
        raise ProtocolError(f"{TYPE_NAMES[frame.type]} of {n} keys with a {frame.body.nbytes}-byte body")
    body = bytes(frame.body)
    return [body[i : i + KEY_BYTES] for i in range(0, len(body), KEY_BYTES)]


def parse_get(frame: Frame, limits: WireLimits) -> list[bytes]:
    expect_type(frame, GET)
    return _parse_keys(frame, limits)


@dataclass(frozen=True)
class LookupKeys:
    """A LOOKUP request: how many leading ``keys`` the tenant's store holds."""

    keys: list[bytes]


def parse_lookup(frame: Frame, limits: WireLimits) -> LookupKeys:
    expect_type(frame, LOOKUP)
    return LookupKeys(_parse_keys(frame, limits))


def parse_lookup_reply(frame: Frame, asked: int) -> tuple[int, str]:
    """(hits, reason) of a LOOKUP of ``asked`` keys; hits never exceed ``asked``."""
    expect_type(frame, LOOKUP_REPLY)
    if frame.header.count > asked:
        raise ProtocolError(f"LOOKUP_REPLY of {frame.header.count} hits for {asked} keys")
    return frame.header.count, parse_text(frame)


@dataclass(frozen=True)
class ShmRef:
    """``length`` bytes at ``offset`` of the connection's shared segment, or with ``arena`` of
    the tenant's arena (unchecked: the receiver checks the range against what it mapped)."""

    offset: int
    length: int
    arena: bool = False

    def within(self, size: int) -> bool:
        return self.offset + self.length <= size


@dataclass(frozen=True)
class PutItem:
    key: bytes
    parent: bytes
    depth: int
    chunk: memoryview | ShmRef
    more: bool


def parse_ref(body: memoryview, what: str, arena: bool = False) -> ShmRef:
    if body.nbytes != _REF.size:
        raise ProtocolError(f"{what} shared-memory reference of {body.nbytes} bytes, expected {_REF.size}")
    offset, length = _REF.unpack(body)
    return ShmRef(offset, length, arena)


def parse_put(frame: Frame) -> PutItem:
    expect_type(frame, PUT)
    if frame.header.flags & ARENA:
        raise ProtocolError("PUT with the ARENA flag (only a CHUNK may reference the arena)")
    head = 2 * KEY_BYTES if frame.header.flags & PARENT else KEY_BYTES
    if frame.body.nbytes < head:
        raise ProtocolError(f"PUT body of {frame.body.nbytes} bytes has no room for its keys")
    body = frame.body
    if frame.tail is not None:  # split by the receiver: the keys in body, the chunk in tail
        return split_put(frame.header.flags, frame.header.count, body, frame.tail)
    parent = bytes(body[KEY_BYTES:head]) if head > KEY_BYTES else b""
    chunk: memoryview | ShmRef = parse_ref(body[head:], "PUT") if frame.header.flags & SHM else body[head:]
    return PutItem(bytes(body[:KEY_BYTES]), parent, frame.header.count, chunk, bool(frame.header.flags & MORE))


def split_put(flags: int, count: int, keys: memoryview, chunk: memoryview) -> PutItem:
    """A PUT frame whose receiver put the keys in ``keys`` and the chunk, inline on the wire,
    in ``chunk`` (a frame reader's target, or kvtier.server.put_run's slot): the checks
    :func:`parse_put` makes of such a frame (``flags`` without SHM: the chunk is here)."""
    if flags & ARENA:
        raise ProtocolError("PUT with the ARENA flag (only a CHUNK may reference the arena)")
    head = 2 * KEY_BYTES if flags & PARENT else KEY_BYTES
    if keys.nbytes != head or flags & SHM:
        raise ProtocolError(f"PUT split after {keys.nbytes} bytes, its keys take {head}")
    return PutItem(bytes(keys[:KEY_BYTES]), bytes(keys[KEY_BYTES:]), count, chunk, bool(flags & MORE))


@dataclass(frozen=True)
class ShmOffer:
    """SHM_READY: where to fetch the segment's descriptor, with which ticket, and its size;
    ``arena_size`` > 0: the tenant's arena comes too (a second, read-only descriptor)."""

    socket: str  # abstract Unix socket name, without the leading NUL
    ticket: str
    size: int
    arena_size: int = 0


def parse_shm_ready(frame: Frame) -> ShmOffer:
    expect_type(frame, SHM_READY)
    info = _json_object(frame, "SHM_READY")
    sock, ticket, size = info.get("socket"), info.get("ticket"), info.get("size")
    if (not isinstance(sock, str) or not sock or not isinstance(ticket, str) or not ticket
            or not isinstance(size, int) or isinstance(size, bool) or size <= 0):
        raise ProtocolError("SHM_READY needs a socket, a ticket and a positive size")
    arena = info.get("arena", 0)
    if not isinstance(arena, int) or isinstance(arena, bool) or arena < 0:
        raise ProtocolError(f"SHM_READY arena size must be a non-negative integer, got {arena!r}")
    return ShmOffer(sock, ticket, size, arena)


def parse_put_reply(frame: Frame, expected: int) -> list[bool]:
    expect_type(frame, PUT_REPLY)
    if frame.header.count != expected or frame.body.nbytes != expected:
        raise ProtocolError(f"PUT_REPLY for {frame.header.count} items, expected {expected}")
    return [b != 0 for b in frame.body]

"""Decoding and validation of client requests, shared by the gRPC servicer and the data path.

Requests arrive as raw bytes (the servicer registers identity deserializers) so that a
malformed message is answered here with INVALID_ARGUMENT and a message, rather than by
grpc's generic INTERNAL "Exception deserializing request!". Every function either returns
validated values or raises :class:`BadRequest`; nothing else escapes (the hypothesis fuzz
in tests/test_server_badinput.py holds them to that). Pure: no I/O, thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import xxhash
from google.protobuf.message import DecodeError, Message

from kvtier.chunk import HEADER_SIZE, decode_header, header_names, payload_checksum
from kvtier.errors import ChunkError
from kvtier.keys import KEY_BYTES
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.tiers.base import Entry


class BadRequest(Exception):
    """A request the server refuses; ``code`` is the gRPC status to answer with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Limits:
    """What a request may carry; advertised to clients by Info."""

    max_batch_keys: int = 4096
    max_chunk_bytes: int = 32 << 20
    max_message_bytes: int = 64 << 20


def _parse(message_type: type[Message], raw: bytes, what: str) -> Any:
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: expected serialized bytes")
    msg = message_type()
    try:
        msg.ParseFromString(bytes(raw))
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: not a valid {message_type.__name__}: {exc}") from None
    return msg


def check_keys(keys: Sequence[bytes], limits: Limits, what: str = "request") -> list[bytes]:
    if len(keys) > limits.max_batch_keys:
        raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{what}: {len(keys)} keys; at most max_batch_keys={limits.max_batch_keys} per request")
    out = list(keys)
    for i, key in enumerate(out):
        if len(key) != KEY_BYTES:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                             f"{what}: key {i} has {len(key)} bytes; keys are {KEY_BYTES} bytes")
    return out


def _varint(raw: memoryview, at: int) -> tuple[int, int]:
    """(value, next offset) of the protobuf varint at ``at``; DecodeError when cut off or
    longer than 10 bytes."""
    value = shift = 0
    for i in range(at, min(at + 10, len(raw))):
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i + 1
        shift += 7
    raise DecodeError("a varint is cut off or longer than 10 bytes")


def _check_field_count(raw: bytes | bytearray | memoryview, limit: int, what: str) -> None:
    """Refuse a message with more than ``limit`` top-level fields before protobuf builds an
    object for each: 63 MiB of two-byte empty items once took 2.5 GiB and 7 s of the GIL to
    parse, only for the count to be refused afterwards. Walks at most ``limit + 1`` field
    headers; malformed bytes are left for the parser to name."""
    view, at, fields = memoryview(raw).cast("B"), 0, 0
    try:
        while at < len(view):
            fields += 1
            if fields > limit:
                raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{what}: more than max_batch_keys={limit} items in one message")
            tag, at = _varint(view, at)
            wire = tag & 7
            if wire == 0:
                _, at = _varint(view, at)
            elif wire == 1:
                at += 8
            elif wire == 2:
                length, at = _varint(view, at)
                at += length
            elif wire == 5:
                at += 4
            else:
                return  # groups or garbage: the parser refuses or handles it
    except DecodeError:
        return


def decode_keys(raw: bytes, kind: str, limits: Limits) -> list[bytes]:
    """Keys of a Lookup, Get or Delete request. A message larger than ``max_batch_keys`` keys
    can be (each takes 34 bytes: tag, length, 32 bytes) is refused unparsed: parsing 63 MiB of
    empty keys took a second and a GiB, on the server's event loop."""
    if isinstance(raw, (bytes, bytearray, memoryview)) and len(raw) > limits.max_batch_keys * (KEY_BYTES + 2):
        raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{kind}: a {len(raw)}-byte request holds more than max_batch_keys="
                         f"{limits.max_batch_keys} keys of {KEY_BYTES} bytes")
    types = {"Lookup": pb.LookupRequest, "Get": pb.GetRequest, "Delete": pb.DeleteRequest}
    msg = _parse(types[kind], raw, kind)
    return check_keys(msg.keys, limits, kind)


def decode_stats(raw: bytes) -> str:
    msg = _parse(pb.StatsRequest, raw, "Stats")
    tenant: str = msg.tenant
    if len(tenant) > 256:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, "Stats: tenant name longer than 256 characters")
    return tenant


def decode_info(raw: bytes) -> None:
    _parse(pb.InfoRequest, raw, "Info")


def decode_put(raw: bytes, limits: Limits, first_index: int = 0) -> list[Entry]:
    """Entries of one PutRequest message, each chunk verified (see :func:`verify_chunk`)."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        _check_field_count(raw, limits.max_batch_keys, "Put")
    msg = _parse(pb.PutRequest, raw, "Put")
    items = msg.items
    if len(items) > limits.max_batch_keys:
        raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"Put: {len(items)} items in one message; at most max_batch_keys={limits.max_batch_keys}")
    entries = []
    for i, item in enumerate(items, first_index):
        entries.append(make_entry(item.key, item.chunk, item.depth, item.parent, limits, i))
    return entries


def make_entry(key: bytes, chunk: bytes | memoryview, depth: int, parent: bytes, limits: Limits,
               index: int, payload_hash: int | None = None) -> Entry:
    """``payload_hash``: xxh3 of the chunk's payload where the caller computed it already
    (kvtier.server.put_run, while the bytes were in cache); None: computed here."""
    what = f"Put item {index}"
    if len(key) != KEY_BYTES:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: key has {len(key)} bytes; keys are {KEY_BYTES} bytes")
    if parent and len(parent) != KEY_BYTES:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what}: parent key has {len(parent)} bytes; expected 0 or {KEY_BYTES}")
    verify_chunk(key, chunk, limits, what, payload_hash)
    return Entry(key, chunk, depth, parent)


def verify_chunk(key: bytes, chunk: bytes | memoryview, limits: Limits, what: str,
                 payload_hash: int | None = None) -> None:
    """A stored chunk must be exactly one whole, intact kvtier chunk of ``key``.

    Contradictions (another key in the header, a length the header disagrees with, not a chunk
    at all) are INVALID_ARGUMENT; failed checksums are DATA_LOSS; too big is RESOURCE_EXHAUSTED.
    """
    n = len(chunk)
    if n > limits.max_chunk_bytes:
        raise BadRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"{what}: chunk of {n} bytes exceeds max_chunk_bytes={limits.max_chunk_bytes}")
    if header_names(chunk, key):  # the usual case: one whole chunk of this key, its header sound
        expected = payload_checksum(chunk)
    else:
        expected = _refusal(key, chunk, what)
    if payload_hash is None:
        payload_hash = xxhash.xxh3_64_intdigest(memoryview(chunk)[HEADER_SIZE:])
    if payload_hash != expected:
        raise BadRequest(grpc.StatusCode.DATA_LOSS, f"{what}: payload checksum mismatch (corrupt chunk)")


def _refusal(key: bytes, chunk: bytes | memoryview, what: str) -> int:
    """Why header_names refused ``chunk``, as the BadRequest a client gets (decode_header's
    reason, or the key or length it contradicts)."""
    n = len(chunk)
    try:
        header = decode_header(chunk)
    except ChunkError as exc:
        code = grpc.StatusCode.DATA_LOSS if exc.reason == "corrupt" else grpc.StatusCode.INVALID_ARGUMENT
        raise BadRequest(code, f"{what}: not a valid kvtier chunk ({exc})") from None
    if header.key != key:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what}: chunk header names key {header.key.hex()[:16]}..., "
                         f"the request key is {key.hex()[:16]}...")
    if header.nbytes != n:
        raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{what}: chunk is {n} bytes but its header says {header.nbytes}")
    return header.checksum  # (header_names and decode_header agree: not reached)

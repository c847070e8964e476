"""Fuzz of the data path's sans-I/O decoders (kvtier.protocol): mutated valid conversations and
structured bodies, in both directions.

tests/test_server_session.py feeds random bytes and random bodies behind valid headers; random
bytes rarely get past the magic, and no body there is JSON. Here each example is a real
conversation (client to server: HELLO, GET, LOOKUP, PUT batches inline and by reference, the
shared-memory handshake; server to client: WELCOME, SHM_READY, CHUNK/MISS/ERROR replies,
PUT_REPLY, LOOKUP_REPLY), encoded by the real encoders, then mutated (a header field rewritten,
a byte changed, the stream cut or spliced) and fed to a FrameReader in arbitrary pieces, each
frame to the parser its side uses. The JSON bodies (WELCOME, SHM_READY) also get arbitrary
JSON values and JSON nested deeper than the parser's stack. The contract under test
(kvtier.protocol.frames): every decoding problem raises ProtocolError, nothing else escapes,
and the reader never holds a body larger than its limits allow.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol.frames import (
    CHUNK,
    ERROR,
    HELLO_MAX,
    LOOKUP_REPLY,
    MISS,
    PUT,
    PUT_REPLY,
    SHM_READY,
    WELCOME,
    Frame,
    FrameHeader,
    FrameReader,
    ProtocolError,
    ShmOffer,
    WireLimits,
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
    parse_lookup_reply,
    parse_put_reply,
    parse_shm_ready,
    parse_text,
    parse_welcome,
    welcome_ops,
)
from kvtier.protocol.session import GetReplyCollector, ServerSession
from tests.kvtier_servers import make_keys
from tests.wire_frames import LIMITS, join

KEYS = make_keys(6, seed=11)


def _nested(depth: int, kind: str) -> bytes:
    if kind == "array":
        return b"[" * depth + b"]" * depth
    if kind == "object":
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b'{"socket":' + b"[" * depth + b"]" * depth + b"}"  # deep inside a valid-looking object


def test_json_nested_deeper_than_the_parser_stack_is_a_protocol_error() -> None:
    """A server's WELCOME or SHM_READY of 5,000 nested arrays (10 KB, well under the 64 KiB
    control limit): json raised RecursionError, which escaped the parsers and the client's handshake
    (it catches ProtocolError and OSError: the socket was not even closed)."""
    for kind in ("array", "object", "inner"):
        body = _nested(5_000, kind)
        assert len(body) <= LIMITS.max_control_bytes
        for ftype, parse in ((WELCOME, parse_welcome), (SHM_READY, parse_shm_ready)):
            frame = Frame(FrameHeader(ftype, 0, 0, len(body)), memoryview(body))
            try:
                parse(frame)
            except ProtocolError as exc:
                assert ("WELCOME" if ftype == WELCOME else "SHM_READY") in str(exc)
            else:
                raise AssertionError(f"{kind} nesting parsed as a {ftype} body")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["socket", "ticket", "size", "arena", "ops", "tenant", "x"]), inner, max_size=5),
    max_leaves=12)


def _json_body(draw: Any) -> bytes:
    how = draw(st.sampled_from(["value", "value", "nested", "bytes", "bignum"]))
    if how == "value":
        return json.dumps(draw(json_values)).encode()
    if how == "nested":
        return _nested(draw(st.integers(1, 10_000)), draw(st.sampled_from(["array", "object", "inner"])))
    if how == "bignum":  # past int()'s digit limit: a ValueError inside json
        return b'{"socket":"s","ticket":"t","size":' + b"9" * draw(st.integers(4000, 5000)) + b"}"
    return draw(st.binary(max_size=64))


@settings(max_examples=400, deadline=None)
@given(data=st.data())
def test_json_bodies_give_a_value_or_a_protocol_error(data: st.DataObject) -> None:
    body = _json_body(data.draw)
    view = memoryview(body)
    try:
        info = parse_welcome(Frame(FrameHeader(WELCOME, 0, 0, len(body)), view))
        assert isinstance(info, dict)
        welcome_ops(info)
    except ProtocolError:
        pass
    try:
        offer = parse_shm_ready(Frame(FrameHeader(SHM_READY, 0, 0, len(body)), view))
    except ProtocolError:
        return
    assert isinstance(offer.socket, str) and offer.socket and isinstance(offer.ticket, str) and offer.ticket
    assert type(offer.size) is int and offer.size > 0 and type(offer.arena_size) is int and offer.arena_size >= 0


def _client_stream(n: int) -> bytes:
    """A client's whole conversation: HELLO, then requests of every kind."""
    parts: list[Any] = list(encode_hello("token"))
    parts += encode_get(KEYS[:n]) + encode_lookup(KEYS[:n]) + encode_shm_open() + encode_shm_mapped(True, True)
    for i in range(n):
        parts += encode_put(KEYS[i], bytes([i]) * (40 + i), depth=i, parent=KEYS[i - 1] if i else b"", more=i < n - 1)
    parts += encode_put_ref(KEYS[0], 64, 4096, more=True) + encode_put_ref(KEYS[1], 1 << 63, 1 << 63, parent=KEYS[0])
    return join(parts)


def _server_stream(n: int) -> bytes:
    """What a server sends: WELCOME, SHM_READY, a GET reply, PUT_REPLY, LOOKUP_REPLY."""
    parts: list[Any] = list(encode_welcome({"tenant": "t", "max_chunk_bytes": 1 << 16, "ops": ["lookup"]}))
    parts += encode_shm_ready(ShmOffer("kvtier-shm-x", "ticket", 1 << 20, 1 << 22))
    for i in range(n):
        kind = i % 4
        parts += (encode_chunk(i, bytes(100 + i)) if kind == 0 else encode_miss(i, "absent") if kind == 1
                  else encode_chunk_ref(i, 128 * i, 100, arena=bool(i % 2)) if kind == 2 else encode_chunk(i, b""))
    parts += encode_put_reply([True, False] * n) + encode_lookup_reply(n // 2, "absent") + encode_error(5, "no")
    return join(parts)


def _frame_starts(data: bytes) -> list[int]:
    """Where each frame of a valid stream starts (its header)."""
    starts, at = [], 0
    while at + 16 <= len(data):
        starts.append(at)
        at += 16 + int.from_bytes(data[at + 8 : at + 16], "little")
    return starts


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """``data`` (a valid stream) with ``edits``: (op, position, value), applied in order."""
    out, starts = bytearray(data), _frame_starts(data)
    for op, pos, value in edits:
        if not out:
            break
        at, head = pos % len(out), starts[pos % len(starts)]
        if op == 0:  # any byte
            out[at] = value & 0xFF
        elif op == 1 and head + 16 <= len(out):  # a header field: type, flags, count or length bytes
            out[head + (2, 3, 4, 7, 8, 11, 15)[value % 7]] = value >> 3 & 0xFF
        elif op == 2:  # cut
            del out[at:]
        elif op == 3:  # splice a copy of a stretch elsewhere (a frame twice, a header inside a body)
            stretch = out[at : at + 1 + value % 64]
            out[(at * 7 + value) % len(out) : (at * 7 + value) % len(out)] = stretch
        elif op == 4 and head + 16 <= len(out):  # a length field made huge, zero or off by a little
            length = int.from_bytes(out[head + 8 : head + 16], "little")
            length = ((1 << 64) - 1, 0, length + 1, max(length - 1, 0), 1 << 32)[value % 5]
            out[head + 8 : head + 16] = (length % (1 << 64)).to_bytes(8, "little")
    return bytes(out)


edits = st.lists(st.tuples(st.integers(0, 4), st.integers(0, 1 << 20), st.integers(0, 2047)), max_size=4)
pieces = st.lists(st.integers(1, 300), max_size=12)


def _feed(data: bytes, cuts: list[int], limits: WireLimits):  # type: ignore[no-untyped-def]
    """The frames of ``data`` fed in pieces; the reader's own buffer is checked after each."""
    reader, pos = FrameReader(limits), 0
    for cut in cuts + [len(data)]:
        for frame in reader.feed(data[pos : pos + cut]):
            assert frame.body.nbytes <= limits.max_body(frame.type)
            yield frame
        assert len(reader._own) <= limits.max_body(PUT)  # never a body past the limits
        pos += cut


@settings(max_examples=500, deadline=None)
@given(n=st.integers(1, 6), edits=edits, cuts=pieces)
def test_mutated_client_conversations_give_requests_or_a_protocol_error(n: int, edits: list[tuple[int, int, int]],
                                                                        cuts: list[int]) -> None:
    """The server's side: a reader in handshake limits for the first frame, then the session."""
    data = _mutate(_client_stream(n), edits)
    session = ServerSession(LIMITS)
    try:
        handshake = FrameReader(WireLimits.handshake())  # as the data plane reads HELLO
        got = handshake.feed(data[:16])
        if len(data) < 16:
            return
        if not got:
            got = handshake.feed(data[16 : 16 + handshake.need()])
        if not got:
            return  # cut inside HELLO
        assert got[0].body.nbytes <= HELLO_MAX
        session.accept(got[0])
        for frame in _feed(data[16 + got[0].header.length :], cuts, LIMITS):
            session.accept(frame)
    except ProtocolError:
        pass


@settings(max_examples=500, deadline=None)
@given(n=st.integers(1, 8), edits=edits, cuts=pieces)
def test_mutated_server_conversations_give_replies_or_a_protocol_error(n: int, edits: list[tuple[int, int, int]],
                                                                       cuts: list[int]) -> None:
    """The client's side: each frame to the parser the client uses at that point."""
    data = _mutate(_server_stream(n), edits)
    collector = GetReplyCollector(n)
    try:
        for i, frame in enumerate(_feed(data, cuts, LIMITS)):
            if i == 0:
                welcome_ops(parse_welcome(frame))
            elif i == 1:
                parse_shm_ready(frame)
            elif not collector.done:
                collector.accept(frame)
            elif frame.type == PUT_REPLY:
                assert len(parse_put_reply(frame, 2 * n)) == 2 * n
            elif frame.type == LOOKUP_REPLY:
                assert parse_lookup_reply(frame, n)[0] <= n
            elif frame.type in (ERROR, MISS, CHUNK):
                parse_text(frame)
    except ProtocolError:
        pass

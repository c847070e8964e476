"""kvtier.protocol.frames, sans-I/O: a client and a server session talking through in-memory byte
streams (no sockets), split at every possible boundary; the frame reader's body targets and
header checks. The session's rules and the decoder fuzz: tests/test_server_session.py."""

from __future__ import annotations

import pytest

from kvtier.protocol.frames import (
    CHUNK,
    GET,
    LOOKUP,
    LOOKUP_REPLY,
    PUT,
    PUT_REPLY,
    WELCOME,
    Frame,
    FrameHeader,
    FrameReader,
    LookupKeys,
    ProtocolError,
    PutItem,
    encode_chunk,
    encode_error,
    encode_get,
    encode_header,
    encode_hello,
    encode_lookup,
    encode_lookup_reply,
    encode_miss,
    encode_put,
    encode_put_reply,
    encode_welcome,
    parse_lookup,
    parse_lookup_reply,
    parse_put,
    parse_put_reply,
    parse_welcome,
    welcome_ops,
)
from kvtier.protocol.session import GetReplyCollector, ServerSession
from tests.kvtier_servers import make_keys
from tests.wire_frames import LIMITS, join
from tests.wire_frames import frames as _frames


class MemoryServer:
    """A toy server over the sans-I/O pieces: what dataplane.py does, minus the sockets."""

    def __init__(self) -> None:
        self.reader = FrameReader(LIMITS)
        self.session = ServerSession(LIMITS)
        self.store: dict[bytes, bytes] = {}
        self.batch: list[bool] = []

    def receive(self, data: bytes) -> bytes:
        out: list = []
        for frame in self.reader.feed(data):
            request = self.session.accept(frame)
            if isinstance(request, str):
                out += encode_welcome({"tenant": "t"}) if request == "good-token" else encode_error(16, "no")
            elif isinstance(request, LookupKeys):
                hits = next((i for i, k in enumerate(request.keys) if k not in self.store), len(request.keys))
                out += encode_lookup_reply(hits, "absent")
            elif isinstance(request, list):
                for i, key in enumerate(request):
                    value = self.store.get(key)
                    out += encode_chunk(i, value) if value is not None else encode_miss(i, "absent")
            elif isinstance(request, PutItem):
                self.store[request.key] = bytes(request.chunk)
                self.batch.append(len(request.chunk) > 0)
                if not request.more:
                    out += encode_put_reply(self.batch)
                    self.batch = []
        return join(out)


def pump(data: bytes, sink: MemoryServer | FrameReader, step: int) -> list:
    """Deliver ``data`` in pieces of ``step`` bytes (0: one piece)."""
    pieces = [data] if step == 0 else [data[i : i + step] for i in range(0, len(data), step)]
    out: list = []
    for piece in pieces:
        got = sink.receive(piece) if isinstance(sink, MemoryServer) else sink.feed(piece)
        out.append(got) if isinstance(sink, MemoryServer) else out.extend(got)
    return out


@pytest.mark.parametrize("step", [0, 1, 7, 16, 17, 1000])
def test_in_memory_pair_round_trip(step: int) -> None:
    server = MemoryServer()
    client = FrameReader(LIMITS)
    keys = make_keys(5, seed=1)
    values = [bytes([i]) * (100 * i + 1) for i in range(5)]
    # handshake
    reply = b"".join(pump(join(encode_hello("good-token")), server, step))
    (frame,) = pump(reply, client, step)
    assert frame.type == WELCOME and parse_welcome(frame) == {"tenant": "t"}
    # a PUT batch of 4 (MORE on all but the last), one reply
    request = b"".join(join(encode_put(k, v, depth=i, parent=keys[0] if i else b"", more=i < 3))
                       for i, (k, v) in enumerate(zip(keys[:4], values[:4])))
    reply = b"".join(pump(request, server, step))
    (frame,) = pump(reply, client, step)
    assert frame.type == PUT_REPLY and parse_put_reply(frame, 4) == [True] * 4
    assert server.store == dict(zip(keys[:4], values[:4]))
    # a GET of all five: four chunks and one miss, in order
    reply = b"".join(pump(join(encode_get(keys)), server, step))
    collector = GetReplyCollector(5)
    for frame in pump(reply, client, step):
        collector.accept(frame)
    assert collector.done and collector.results == values[:4] + ["absent"]
    # LOOKUPs: the leading run of stored keys, and why it stopped
    for asked, hits in ((keys, 4), (keys[:3], 3), (keys[4:], 0), ([], 0)):
        reply = b"".join(pump(join(encode_lookup(asked)), server, step))
        (frame,) = pump(reply, client, step)
        assert parse_lookup_reply(frame, len(asked)) == (hits, "absent")


def test_lookup_frames() -> None:
    """LOOKUP keeps GET's limits; a reply never claims more hits than keys asked; WELCOME's
    ops are a list of strings, none when absent (an older server)."""
    keys = make_keys(3, seed=2)
    assert parse_lookup(_frames(join(encode_lookup(keys)))[0], LIMITS) == LookupKeys(keys)
    with pytest.raises(ProtocolError, match="LOOKUP of 2 keys with a 32-byte body"):
        parse_lookup(_frames(encode_header(LOOKUP, 0, 2, 32) + b"k" * 32)[0], LIMITS)
    with pytest.raises(ProtocolError, match="exceeds"):  # more keys than max_batch_keys: header refused
        FrameReader(LIMITS).feed(join(encode_lookup(make_keys(65))))
    assert parse_lookup_reply(_frames(join(encode_lookup_reply(2, "evicted")))[0], 3) == (2, "evicted")
    with pytest.raises(ProtocolError, match="4 hits for 3 keys"):
        parse_lookup_reply(_frames(join(encode_lookup_reply(4, "absent")))[0], 3)
    with pytest.raises(ProtocolError, match="not UTF-8"):
        parse_lookup_reply(_frames(encode_header(LOOKUP_REPLY, 0, 0, 2) + b"\xff\xfe")[0], 3)
    with pytest.raises(ProtocolError, match="expected LOOKUP_REPLY"):
        parse_lookup_reply(_frames(join(encode_put_reply([True])))[0], 1)
    assert welcome_ops({"tenant": "t"}) == frozenset()
    assert welcome_ops({"ops": ["lookup", "later"]}) == {"lookup", "later"}
    for bad in ("lookup", [1], {"lookup": 1}):
        with pytest.raises(ProtocolError, match="ops"):
            welcome_ops({"ops": bad})


def test_whole_body_in_bytes_is_not_copied() -> None:
    data = join(encode_chunk(0, b"x" * 5000))
    reader = FrameReader(LIMITS)
    header, body = data[:16], data[16:]
    assert reader.feed(header) == []
    (frame,) = reader.feed(body)
    assert frame.body.obj is body and frame.body_bytes() is body


def test_body_target_receives_the_body() -> None:
    target = memoryview(bytearray(100))

    def where(header: FrameHeader) -> memoryview | None:
        return target if header.type == CHUNK else None

    reader = FrameReader(LIMITS, where)
    data = join(encode_chunk(3, b"abc") + encode_miss(4, "evicted"))
    frames = []
    for i in range(len(data)):  # the zero-copy loop: buffer() / advance() one byte at a time
        buf = reader.buffer()
        buf[:1] = data[i : i + 1]
        frame = reader.advance(1)
        if frame:
            frames.append(frame)
    assert [f.type for f in frames] == [CHUNK, 6]
    assert bytes(target[:3]) == b"abc" and frames[0].body.obj is target.obj


def test_split_body_target_puts_keys_and_chunk_apart() -> None:
    """The server's zero-copy PUT: the keys land in one buffer, the chunk in another (a RAM
    slot), whatever the read boundaries; parse_put reads them from there. A split whose parts
    do not add up to the body is the caller's bug (ValueError)."""
    keys, slot = memoryview(bytearray(64)), memoryview(bytearray(5000))
    key, parent = b"k" * 32, b"p" * 32

    def where(header: FrameHeader) -> tuple[memoryview, memoryview] | None:
        return (keys, slot[: header.length - 64]) if header.type == PUT else None

    data = join(encode_put(key, b"c" * 3000, 7, parent, more=True) + encode_miss(1, "absent"))
    for step in (1, 7, 16, 100, len(data)):
        reader = FrameReader(LIMITS, where)
        slot[:] = b"\0" * 5000
        frames = pump(data, reader, step)
        assert [f.type for f in frames] == [PUT, 6]
        assert frames[0].tail is not None and frames[0].tail.obj is slot.obj
        assert bytes(slot[:3000]) == b"c" * 3000 and bytes(slot[3000:3001]) == b"\0"
        item = parse_put(frames[0])
        assert (item.key, item.parent, item.depth, item.more) == (key, parent, 7, True)
        assert isinstance(item.chunk, memoryview) and item.chunk.obj is slot.obj
    short = FrameReader(LIMITS, lambda h: (keys, slot[:10]) if h.type == PUT else None)
    with pytest.raises(ValueError, match="split body target"):
        short.feed(data)
    bad = Frame(FrameHeader(PUT, 0, 0, 3064), memoryview(bytes(64)), memoryview(bytes(3000)))
    with pytest.raises(ProtocolError, match="split after 64 bytes"):
        parse_put(bad)  # no PARENT flag: its keys take 32 bytes


def _scatter(views: list[memoryview], data: bytes) -> int:
    """What ``recvmsg_into(views)`` does with ``data``: fill the views in order."""
    pos = 0
    for v in views:
        n = min(v.nbytes, len(data) - pos)
        v[:n] = data[pos : pos + n]
        pos += n
    return pos


def test_split_buffers_take_keys_and_chunk_in_one_read() -> None:
    """``split_buffers`` (read_frame's one ``recvmsg_into`` for a PUT's keys and chunk): the
    first part's missing bytes and the whole second part while the first is being read, None
    at a header, after the first part and for an unsplit body; a scatter read of any length
    advances the reader as separate reads would."""
    key, chunk = b"k" * 32, bytes(range(256)) * 12
    data = join(encode_put(key, chunk, 3, more=False) + encode_miss(1, "absent"))
    for first in (1, 31, 32, 33, 100, len(chunk) + 32):
        keys, slot = memoryview(bytearray(32)), memoryview(bytearray(len(chunk)))
        reader = FrameReader(LIMITS, lambda h, k=keys, s=slot: (k, s) if h.type == PUT else None)
        assert reader.split_buffers() is None  # a header comes first
        reader.buffer()[:16] = data[:16]
        assert reader.advance(16) is None
        split = reader.split_buffers()
        assert split is not None and [v.nbytes for v in split] == [32, len(chunk)]
        pos, frame = 16, None
        while frame is None:
            views = reader.split_buffers() or [reader.buffer()]
            n = _scatter(views, data[pos : pos + (first if pos == 16 else 4096)])
            pos += n
            frame = reader.advance(n)
            assert reader.split_buffers() is None or pos - 16 < 32
        assert bytes(keys) == key and bytes(slot) == chunk and frame.tail is not None
        assert parse_put(frame).chunk.obj is slot.obj  # type: ignore[union-attr]
        assert reader.split_buffers() is None  # the MISS frame's header is next
    unsplit = FrameReader(LIMITS)
    unsplit.buffer()[:16] = data[:16]
    unsplit.advance(16)
    assert unsplit.split_buffers() is None


def test_buffer_never_spans_two_frames() -> None:
    reader = FrameReader(LIMITS)
    assert len(reader.buffer()) == 16
    reader.buffer()[:16] = encode_header(CHUNK, 0, 0, 10)
    assert reader.advance(16) is None and len(reader.buffer()) == 10 and reader.need() == 10
    with pytest.raises(ValueError):
        reader.advance(11)


@pytest.mark.parametrize("data, message", [
    (b"XX" + bytes(14), "magic"),
    (encode_header(42, 0, 0, 0), "unknown frame type"),
    (encode_header(CHUNK, 0x80, 0, 0), "flags"),
    (encode_header(CHUNK, 0, 0, (1 << 16) + 65), "exceeds"),
    (encode_header(GET, 0, 0, 64 * 32 + 1), "exceeds"),
])
def test_bad_headers(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        FrameReader(LIMITS).feed(data)

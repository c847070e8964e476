"""kvtier.protocol.session, sans-I/O: which frame a server session takes when (order rules, the
shared-memory handshake, PUT batches, the split PUT a receiver hands it), the client's GET
reply collector, and a hypothesis fuzz of decoder and session: whatever bytes arrive, the
only error is ProtocolError."""

from __future__ import annotations

import random
from functools import partial

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol.frames import (
    ARENA,
    CHUNK,
    ERROR,
    GET,
    LOOKUP,
    LOOKUP_REPLY,
    PARENT,
    PUT,
    PUT_REPLY,
    SHM,
    SHM_MAPPED,
    SHM_OPEN,
    WELCOME,
    Frame,
    FrameHeader,
    FrameReader,
    ProtocolError,
    PutItem,
    ShmOffer,
    ShmRef,
    encode_chunk,
    encode_chunk_ref,
    encode_error,
    encode_get,
    encode_header,
    encode_hello,
    encode_lookup,
    encode_miss,
    encode_put,
    encode_put_ref,
    encode_put_reply,
    encode_shm_mapped,
    encode_shm_open,
    encode_shm_ready,
    parse_lookup_reply,
    parse_put,
    parse_shm_ready,
)
from kvtier.protocol.session import GetReplyCollector, ServerSession, ShmControl
from tests.kvtier_servers import make_keys
from tests.wire_frames import LIMITS, join
from tests.wire_frames import frames as _frames


def test_session_order_rules() -> None:
    session = ServerSession(LIMITS)
    with pytest.raises(ProtocolError, match="HELLO"):
        session.accept(_frames(join(encode_get([])))[0])
    session = ServerSession(LIMITS)
    assert session.accept(_frames(join(encode_hello("t")))[0]) == "t"
    with pytest.raises(ProtocolError, match="unexpected HELLO"):
        session.accept(_frames(join(encode_hello("t")))[0])
    key = make_keys(1)[0]
    session.accept(_frames(join(encode_put(key, b"v", more=True)))[0])
    with pytest.raises(ProtocolError, match="unexpected GET"):  # no GET inside a PUT batch
        session.accept(_frames(join(encode_get([key])))[0])
    with pytest.raises(ProtocolError, match="unexpected LOOKUP"):  # nor a LOOKUP
        session.accept(_frames(join(encode_lookup([key])))[0])
    with pytest.raises(ProtocolError, match="version"):
        ServerSession(LIMITS).accept(_frames(encode_header(1, 0, 9, 0))[0])
    with pytest.raises(ProtocolError, match="GET of 2 keys"):
        s2 = ServerSession(LIMITS)
        s2.accept(_frames(join(encode_hello("")))[0])
        s2.accept(_frames(encode_header(GET, 0, 2, 32) + b"k" * 32)[0])
    with pytest.raises(ProtocolError, match="no room"):
        s3 = ServerSession(LIMITS)
        s3.accept(_frames(join(encode_hello("")))[0])
        s3.accept(_frames(encode_header(PUT, 2, 0, 40) + b"k" * 40)[0])


def test_shared_memory_frames() -> None:
    session = ServerSession(LIMITS)
    session.accept(_frames(join(encode_hello("")))[0])
    assert session.accept(_frames(join(encode_shm_open()))[0]) == ShmControl(SHM_OPEN, 0)
    offer = ShmOffer("kvtier-shm-ab", "t" * 32, 1 << 20)
    (ready,) = _frames(join(encode_shm_ready(offer)))
    assert parse_shm_ready(ready) == offer
    assert session.accept(_frames(join(encode_shm_mapped(True)))[0]) == ShmControl(SHM_MAPPED, 1)
    key, parent = make_keys(2, seed=3)
    item = parse_put(_frames(join(encode_put_ref(key, 4096, 1000, depth=7, parent=parent, more=True)))[0])
    assert (item.key, item.parent, item.depth, item.chunk, item.more) == (key, parent, 7, ShmRef(4096, 1000), True)
    assert session.accept(_frames(join(encode_put_ref(key, 0, 10)))[0]).chunk == ShmRef(0, 10)
    c = GetReplyCollector(2)
    c.accept(_frames(join(encode_chunk_ref(0, 64, 100)))[0])
    c.accept(_frames(join(encode_miss(1, "absent")))[0])
    assert c.results == [ShmRef(64, 100), "absent"]
    assert ShmRef(64, 100).within(164) and not ShmRef(64, 100).within(163)
    with pytest.raises(ProtocolError, match="reference of 3 bytes"):  # a ref body must be 16 bytes
        GetReplyCollector(1).accept(_frames(encode_header(CHUNK, 4, 0, 3) + b"abc")[0])
    for bad in (ShmOffer("x", "t", 0), ShmOffer("", "t", 1), ShmOffer("x", "", 1)):
        with pytest.raises(ProtocolError, match="socket, a ticket and a positive size"):
            parse_shm_ready(_frames(join(encode_shm_ready(bad)))[0])


def test_collector_checks_order_and_errors() -> None:
    c = GetReplyCollector(2)
    with pytest.raises(ProtocolError, match="index 1"):
        c.accept(_frames(join(encode_chunk(1, b"x")))[0])
    c = GetReplyCollector(2)
    c.accept(_frames(join(encode_error(3, "bad key")))[0])
    assert c.done and c.error == (3, "bad key")
    c = GetReplyCollector(1)
    with pytest.raises(ProtocolError):
        c.accept(_frames(join(encode_put_reply([True])))[0])
    assert _frames(join(encode_error(5, "x")))[0].type == ERROR


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(1, 50), max_size=10))
def test_fuzz_decoder_and_session(data: bytes, cuts: list[int]) -> None:
    """Random bytes (or random bytes after a valid HELLO) raise ProtocolError or decode."""
    reader, session = FrameReader(LIMITS), ServerSession(LIMITS)
    stream = join(encode_hello("tok")) + data if cuts and cuts[0] % 2 else data
    pos = 0
    try:
        for cut in cuts + [len(stream)]:
            for frame in reader.feed(stream[pos : pos + cut]):
                session.accept(frame)
            pos += cut
    except ProtocolError:
        return


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=16, max_size=200))
def test_fuzz_valid_header_random_body(data: bytes) -> None:
    rng = random.Random(data)
    ftype = rng.choice([GET, PUT, CHUNK, PUT_REPLY, WELCOME, LOOKUP, LOOKUP_REPLY])
    body = data[16:]
    try:
        frames = FrameReader(LIMITS).feed(encode_header(ftype, rng.choice([0, 1, 2, 3]), rng.randrange(0, 70),
                                                        len(body)) + body)
    except ProtocolError:
        return
    session = ServerSession(LIMITS)
    session.accept(_frames(join(encode_hello("")))[0])
    for frame in frames:
        try:
            session.accept(frame)
        except ProtocolError:
            pass
        try:
            GetReplyCollector(70).accept(frame)
        except ProtocolError:
            pass
        try:
            hits, _ = parse_lookup_reply(frame, 40)
            assert hits <= 40
        except ProtocolError:
            pass


def _outcome(call: object) -> tuple[str, object]:
    """What a session call gave: ("item", its fields) or ("error", the message)."""
    assert callable(call)
    try:
        item = call()
    except ProtocolError as exc:
        return "error", str(exc)
    assert isinstance(item, PutItem) and isinstance(item.chunk, memoryview)
    return "item", (item.key, item.parent, item.depth, bytes(item.chunk), item.more)


@settings(max_examples=400, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 15), st.integers(0, (1 << 32) - 1), st.sampled_from([0, 32, 64, 96]),
                               st.binary(min_size=1, max_size=40)), min_size=1, max_size=70))
def test_split_put_accepts_what_accept_accepts(runs: list[tuple[int, int, int, bytes]]) -> None:
    """kvtier.server.put_run hands the session each PUT it received in C as keys and a chunk
    (``accept_split_put``) rather than as a frame. Against ``accept`` of the same frame whole
    (keys and chunk inline in one body, the other parsing path): the same items and batch
    length checks where the keys are as long as the flags say; an error naming the split
    otherwise (SHM: a split chunk is never a reference), and the same refusal of ARENA."""
    inline, split = ServerSession(LIMITS), ServerSession(LIMITS)
    for s in (inline, split):
        s.accept(_frames(join(encode_hello("")))[0])
    for flags, count, keylen, chunk in runs:
        keys = bytes(range(keylen))
        whole = Frame(FrameHeader(PUT, flags, count, keylen + len(chunk)), memoryview(keys + chunk))
        got = _outcome(partial(split.accept_split_put, flags, count, memoryview(keys), memoryview(chunk)))
        if flags & ARENA:
            assert got == _outcome(partial(inline.accept, whole)) == ("error", "PUT with the ARENA flag (only a "
                                                                              "CHUNK may reference the arena)")
            return
        if flags & SHM or keylen != (64 if flags & PARENT else 32):
            assert got[0] == "error" and "split after" in str(got[1])
            return  # the connection ends on a ProtocolError
        want = _outcome(partial(inline.accept, whole))
        assert got == want
        assert split.in_put == inline.in_put
        if want[0] == "error":
            assert "max_batch_keys" in str(want[1])
            return

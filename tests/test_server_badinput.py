"""Bad input: malformed and random protobuf bytes, oversized messages, wrong key lengths,
chunks that contradict their request or fail their checksum, garbage on the data port. Each
gets a clear status and the server stays up (a Health call after the barrage says SERVING).
The servicer's request decoding is fuzzed in process in tests/test_server_requests_fuzz.py."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.chunk import HEADER_SIZE
from kvtier.protocol.frames import (
    CHUNK,
    ERROR,
    PUT_REPLY,
    WELCOME,
    FrameReader,
    WireLimits,
    encode_get,
    encode_header,
    encode_hello,
    encode_put,
    encode_put_ref,
    encode_shm_mapped,
    encode_shm_open,
)
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.socket_io import read_frame, send_all
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

MAX_MESSAGE = 2 << 20
MAX_CHUNK = 1 << 20
MAX_KEYS = 64
SVC = "/kvtier.v1.KVTier/"
Code = grpc.StatusCode


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("bad"), "--slot-bytes", "1MiB", "--cpu-bytes", "32MiB",
                     "--set", f"max_message_bytes={MAX_MESSAGE}", "--set", f"max_chunk_bytes={MAX_CHUNK}",
                     "--set", f"max_batch_keys={MAX_KEYS}")
    yield s
    assert s.stop() == 0, s.log
    assert "Traceback" not in s.log, s.log


@pytest.fixture(scope="module")
def channel(server: ServerProc) -> Iterator[grpc.Channel]:
    opts = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
    with grpc.insecure_channel(server.address, options=opts) as ch:
        yield ch


def raw_call(channel: grpc.Channel, method: str, payload: bytes) -> tuple[Code, str]:
    """Send ``payload`` as the request bytes of ``method``, bypassing protobuf."""
    try:
        if method == "Put":
            channel.stream_unary(SVC + "Put")(iter([payload]), timeout=10)
        elif method == "Get":
            list(channel.unary_stream(SVC + "Get")(payload, timeout=10))
        else:
            channel.unary_unary(SVC + method)(payload, timeout=10)
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""  # type: ignore[attr-defined]
    return Code.OK, ""


def put_payload(*items: pb.PutItem) -> bytes:
    return pb.PutRequest(items=list(items)).SerializeToString()


def assert_serving(server: ServerProc) -> None:
    with grpc.insecure_channel(server.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert server.alive()


METHODS = ("Info", "Lookup", "Get", "Put", "Delete", "Stats")
MALFORMED = [b"\xff", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12",
             b"\x0f\x00", b"\x0a\x80\x80\x80\x80\x10"]


def test_malformed_protobuf_is_invalid_argument(channel: grpc.Channel, server: ServerProc) -> None:
    for method in METHODS:
        for payload in MALFORMED:
            code, details = raw_call(channel, method, payload)
            assert code == Code.INVALID_ARGUMENT, (method, payload, code, details)
            assert "not a valid" in details
    assert_serving(server)


def test_random_bytes_get_a_clear_status(channel: grpc.Channel, server: ServerProc) -> None:
    rng = random.Random(5)
    seen = set()
    for _ in range(120):
        method = rng.choice(METHODS)
        payload = rng.randbytes(rng.randrange(0, 300))
        code, _ = raw_call(channel, method, payload)
        # Random bytes sometimes parse (unknown fields are legal protobuf): then the decoded
        # request is validated like any other.
        assert code in (Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.DATA_LOSS,
                        Code.PERMISSION_DENIED, Code.NOT_FOUND), (method, payload, code)
        seen.add(code)
    assert Code.INVALID_ARGUMENT in seen
    assert_serving(server)


def test_oversized_messages(channel: grpc.Channel, server: ServerProc) -> None:
    key = make_keys(1, seed=40)[0]
    code, details = raw_call(channel, "Put", put_payload(pb.PutItem(key=key, chunk=make_chunk(key, MAX_MESSAGE + 10))))
    assert code == Code.RESOURCE_EXHAUSTED and "larger than max" in details
    code, details = raw_call(channel, "Put", put_payload(pb.PutItem(key=key, chunk=make_chunk(key, MAX_CHUNK + 10))))
    assert code == Code.RESOURCE_EXHAUSTED and "max_chunk_bytes" in details
    many = pb.LookupRequest(keys=make_keys(MAX_KEYS + 1, seed=41)).SerializeToString()
    for method in ("Lookup", "Get", "Delete"):
        code, details = raw_call(channel, method, many)
        assert code == Code.RESOURCE_EXHAUSTED and "max_batch_keys" in details, (method, details)
    code, details = raw_call(channel, "Stats", pb.StatsRequest(tenant="x" * 1000).SerializeToString())
    assert code == Code.INVALID_ARGUMENT
    assert_serving(server)


def test_wrong_key_lengths(channel: grpc.Channel, server: ServerProc) -> None:
    good = make_keys(2, seed=42)
    for bad in (b"", b"x" * 31, b"x" * 33, b"x" * 64):
        keys = [good[0], bad, good[1]]
        for method in ("Lookup", "Get", "Delete"):
            code, details = raw_call(channel, method, pb.GetRequest(keys=keys).SerializeToString())
            assert code == Code.INVALID_ARGUMENT and "key 1 has" in details and "32 bytes" in details
        code, details = raw_call(channel, "Put", put_payload(pb.PutItem(key=bad, chunk=make_chunk(good[0]))))
        assert code == Code.INVALID_ARGUMENT and "32 bytes" in details
        code, details = raw_call(channel, "Put", put_payload(pb.PutItem(key=good[0], chunk=make_chunk(good[0]),
                                                                         parent=bad or b"p")))
        assert code == Code.INVALID_ARGUMENT and "parent" in details
    assert_serving(server)


def _corrupt(chunk: bytes, offset: int) -> bytes:
    out = bytearray(chunk)
    out[offset] ^= 0x55
    return bytes(out)


def test_chunks_that_lie_or_are_corrupt(channel: grpc.Channel, server: ServerProc) -> None:
    a, b = make_keys(2, seed=43)
    chunk = make_chunk(a, 5000)
    cases: list[tuple[bytes, bytes, Code, str]] = [
        (b, chunk, Code.INVALID_ARGUMENT, "header names key"),           # header contradicts request
        (a, _corrupt(chunk, HEADER_SIZE + 100), Code.DATA_LOSS, "checksum"),  # payload corrupt
        (a, _corrupt(chunk, 40), Code.DATA_LOSS, "header checksum"),     # header corrupt
        (a, chunk[:-1], Code.INVALID_ARGUMENT, "header says"),           # truncated
        (a, chunk + b"\0", Code.INVALID_ARGUMENT, "header says"),        # trailing bytes
        (a, b"not a chunk at all" * 10, Code.INVALID_ARGUMENT, "not a valid kvtier chunk"),
        (a, b"", Code.INVALID_ARGUMENT, "not a valid kvtier chunk"),
    ]
    for key, data, want, needle in cases:
        code, details = raw_call(channel, "Put", put_payload(pb.PutItem(key=key, chunk=data)))
        assert (code, needle in details) == (want, True), (needle, code, details)
    # Nothing of the refused chunks was stored.
    reply = channel.unary_unary(SVC + "Lookup")(pb.LookupRequest(keys=[a]).SerializeToString(), timeout=5)
    assert pb.LookupReply.FromString(reply).hits == 0
    assert_serving(server)


def test_unknown_method(channel: grpc.Channel, server: ServerProc) -> None:
    assert raw_call(channel, "Nope", b"")[0] == Code.UNIMPLEMENTED
    assert_serving(server)


# --- the data port ---------------------------------------------------------------------------
def _data_conn(server: ServerProc) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=5)
    send_all(sock, encode_hello(""))
    assert read_frame(sock, FrameReader(WireLimits())).type == WELCOME
    return sock


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _refused_then_closed(sock: socket.socket, limits: WireLimits | None = None) -> str:
    """Frames the server sent before hanging up (SHM_READY, ...) are skipped; the last must be
    an ERROR naming the protocol error (INVALID_ARGUMENT), then the end of the stream."""
    reader = FrameReader(limits or WireLimits(MAX_CHUNK, MAX_KEYS))
    last = None
    while True:
        try:
            frame = read_frame(sock, reader)
        except (ConnectionError, OSError):
            break
        last = (frame.type, frame.header.count, bytes(frame.body).decode(errors="replace"))
    assert last is not None and last[:2] == (ERROR, Code.INVALID_ARGUMENT.value[0]), last
    assert "protocol error" in last[2], last
    return last[2]


def _stored(server: ServerProc, keys: list[bytes]) -> int:
    """How many of ``keys`` the server holds (one gRPC Lookup per key: any hit counts)."""
    with grpc.insecure_channel(server.address) as ch:
        lookup = ch.unary_unary(SVC + "Lookup")
        return sum(pb.LookupReply.FromString(lookup(pb.LookupRequest(keys=[k]).SerializeToString(),
                                                      timeout=5)).hits for k in keys)


def test_data_port_garbage_and_refusals(server: ServerProc) -> None:
    limits = WireLimits(MAX_CHUNK, MAX_KEYS)
    rng = random.Random(6)
    for garbage in (b"GET / HTTP/1.1\r\n\r\n", rng.randbytes(64), encode_header(99, 0, 0, 0),
                    encode_header(4, 0, 1, 1 << 40), encode_hello("")[0][:8]):
        with socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=10) as sock:
            sock.sendall(garbage)
            if len(garbage) >= 16:  # a frame the protocol forbids: ERROR with the reason, hang up
                _refused_then_closed(sock)
    with _data_conn(server) as sock:  # a frame out of place after the handshake
        send_all(sock, encode_hello(""))
        assert "unexpected HELLO" in _refused_then_closed(sock)
    with _data_conn(server) as sock:  # GET whose body does not hold count keys
        sock.sendall(encode_header(4, 0, 2, 32) + b"k" * 32)
        _refused_then_closed(sock)
    key, first = make_keys(2, seed=46)
    for frames in ([encode_put_ref(key, 0, 100)],                      # a reference, no segment
                   [encode_shm_mapped(True)],                          # no segment pending
                   [encode_shm_open(), encode_shm_mapped(True), encode_put_ref(key, 64 << 20, 10)],
                   # item 0 is good, item 1 breaks the protocol: item 0 must not stay either
                   [encode_put(first, make_chunk(first, 2000), more=True), encode_put_ref(key, 0, 100)]):
        with _data_conn(server) as sock:  # the third: a reference past the segment's end
            for f in frames:
                send_all(sock, f)
            _refused_then_closed(sock)
        assert _stored(server, [key, first]) == 0  # nothing of the refused frames was stored
    with _data_conn(server) as sock:  # refused chunks: ERROR reply, connection still usable
        a, b, big = make_keys(3, seed=44)
        chunk = make_chunk(a, 3000)
        reader = FrameReader(limits)
        for key, data, code in ((b, chunk, Code.INVALID_ARGUMENT), (a, _corrupt(chunk, 500), Code.DATA_LOSS),
                                (big, make_chunk(big, MAX_CHUNK + 10), None)):
            if code is None:  # over the data path's frame limit: a protocol error, hang up
                try:  # the server may hang up while the body is still being sent
                    send_all(sock, encode_put(key, data))
                except (BrokenPipeError, ConnectionResetError):
                    pass
                try:
                    _refused_then_closed(sock)
                except ConnectionResetError:  # unread body bytes make the close a reset
                    pass
                assert _stored(server, [big]) == 0
                break
            send_all(sock, encode_put(key, data))
            frame = read_frame(sock, reader)
            assert frame.type == ERROR and frame.header.count == code.value[0], bytes(frame.body)
            assert _stored(server, [b]) == 0  # the refused item was not stored
            send_all(sock, encode_put(a, chunk))
            frame = read_frame(sock, reader)
            assert frame.type == PUT_REPLY and bytes(frame.body) == b"\x01"
            send_all(sock, encode_get([a]))
            assert read_frame(sock, reader).type == CHUNK
    assert_serving(server)


def test_refused_put_batch_leaves_nothing(server: ServerProc) -> None:
    """A data-path PUT batch is all or nothing, like the gRPC Put: item 1 refused (bad
    checksum) -> ERROR, and item 0, already stored when item 1 arrived, is removed again;
    a chunk that existed before the batch stays."""
    before, a, b = make_keys(3, seed=47)
    with _data_conn(server) as sock:
        reader = FrameReader(WireLimits(MAX_CHUNK, MAX_KEYS))
        send_all(sock, encode_put(before, make_chunk(before, 1000)))
        assert read_frame(sock, reader).type == PUT_REPLY
        send_all(sock, [*encode_put(before, make_chunk(before, 1000), more=True),
                        *encode_put(a, make_chunk(a, 1000), more=True),
                        *encode_put(b, _corrupt(make_chunk(b, 1000), 500), more=True),
                        *encode_put(a, make_chunk(a, 1000))])  # drained, not stored
        frame = read_frame(sock, reader)
        assert frame.type == ERROR and frame.header.count == Code.DATA_LOSS.value[0]
        assert "item 2" in bytes(frame.body).decode(), bytes(frame.body)
    assert _stored(server, [a, b]) == 0
    assert _stored(server, [before]) == 1


def test_messages_of_many_empty_items_are_refused_before_parsing(channel: grpc.Channel, server: ServerProc) -> None:
    """Two bytes per empty item or key: a message within max_message_bytes holds a million of
    them, and parsing them all (an object each) once cost GiBs and seconds of the GIL before
    the count was checked. The count is now checked on the raw bytes first."""
    flood = b"\x0a\x00" * (MAX_MESSAGE // 2 - 8)
    for method in ("Put", "Lookup", "Get", "Delete"):
        code, details = raw_call(channel, method, flood)
        assert code == Code.RESOURCE_EXHAUSTED and "max_batch_keys" in details, (method, code, details)
    # At the limit exactly, the messages parse and are validated as usual.
    code, details = raw_call(channel, "Put", b"\x0a\x00" * MAX_KEYS)
    assert code == Code.INVALID_ARGUMENT and "key has 0 bytes" in details, details
    assert raw_call(channel, "Lookup", pb.LookupRequest(keys=make_keys(MAX_KEYS, seed=48)).SerializeToString())[0] == Code.OK
    assert_serving(server)


def test_a_put_stream_refused_midway_leaves_nothing(channel: grpc.Channel, server: ServerProc) -> None:
    """A Put call is all or nothing across its messages: the second message's corrupt chunk
    takes back what the first newly stored; a chunk that was there before stays."""
    before, a, b = make_keys(3, seed=49)
    assert raw_call(channel, "Put", put_payload(pb.PutItem(key=before, chunk=make_chunk(before, 1000))))[0] == Code.OK
    first = put_payload(pb.PutItem(key=before, chunk=make_chunk(before, 1000)), pb.PutItem(key=a, chunk=make_chunk(a, 1000)))
    second = put_payload(pb.PutItem(key=b, chunk=_corrupt(make_chunk(b, 1000), HEADER_SIZE + 10)))
    with pytest.raises(grpc.RpcError) as info:
        channel.stream_unary(SVC + "Put")(iter([first, second]), timeout=10)
    assert info.value.code() == Code.DATA_LOSS and "item 2" in (info.value.details() or "")  # type: ignore[attr-defined]
    assert _stored(server, [a, b]) == 0
    assert _stored(server, [before]) == 1
    assert_serving(server)

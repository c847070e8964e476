"""The data path client's frame reads over a real socket: one MSG_WAITALL call per body and,
inside a GET reply, the next frame's header read together with the current body. The
server side is a socketpair end that writes real frames in awkward pieces (a header split
across writes, a body and the next header in one write), so every way the bytes can arrive
is taken; the frames read must be exactly the frames written."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvtier.protocol.frames import (
    CHUNK,
    MISS,
    PUT_REPLY,
    ProtocolError,
    WireLimits,
    encode_chunk,
    encode_error,
    encode_header,
    encode_miss,
)
from kvtier.tiers.remote import data_conn
from kvtier.tiers.remote.data_conn import DataConn

REPLY = [("chunk", 70_000), ("miss", 0), ("chunk", 5), ("chunk", 300_000), ("miss", 0), ("chunk", 4097)]


def _wire(seed: int) -> tuple[bytes, list[tuple[int, int, bytes]]]:
    """A GET reply of len(REPLY) frames: its bytes, and (type, index, body) of each frame."""
    rng = random.Random(seed)
    parts: list[bytes] = []
    frames = []
    for i, (kind, size) in enumerate(REPLY):
        if kind == "chunk":
            body = rng.randbytes(size)
            parts += [bytes(p) for p in encode_chunk(i, body)]
            frames.append((CHUNK, i, body))
        else:
            body = f"reason-{i}".encode()
            parts += [bytes(p) for p in encode_miss(i, body.decode())]
            frames.append((MISS, i, body))
    return b"".join(parts), frames


def _cuts(data: bytes, seed: int) -> Iterator[bytes]:
    """``data`` in pieces: some 1-40 bytes (splitting headers), some tens of KiB."""
    rng = random.Random(seed)
    pos = 0
    while pos < len(data):
        n = rng.choice([1, 7, 16, 17, 40, 65536, 100_000])
        yield data[pos : pos + n]
        pos += n


def _send_in_pieces(server: socket.socket, data: bytes, seed: int) -> threading.Thread:
    """A started thread that sends ``data`` in ``_cuts``' awkward pieces, pausing after short
    ones so that the reader blocks on a partial header."""
    def write() -> None:
        for piece in _cuts(data, seed):
            server.sendall(piece)
            if len(piece) < 64:
                time.sleep(0.001)

    writer = threading.Thread(target=write)
    writer.start()
    return writer


@pytest.fixture(params=["c", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """read_reply with kvtier/_replyloop.c reading the runs of CHUNK frames, and without it
    (its Python loop alone): every test here runs on both."""
    if request.param == "python":
        monkeypatch.setattr(data_conn, "C_RECV_CHUNKS", None)
    elif data_conn.C_RECV_CHUNKS is None:
        # CI builds it (same machine image: gcc); elsewhere it is optional.
        assert not os.environ.get("CI"), "kvtier._replyloop was not built: pip install -e . with a C compiler"
        pytest.skip("kvtier._replyloop not built here (optional accelerator)")
    return str(request.param)


@pytest.fixture
def pair(loop: str) -> Iterator[tuple[DataConn, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listener:  # TCP, as the data path uses
        a = socket.create_connection(listener.getsockname())
        b, _ = listener.accept()
    a.settimeout(None)
    conn = DataConn(a, WireLimits())
    yield conn, b
    conn.close()
    b.close()


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("into", [True, False])
def test_reply_frames_read_exactly(pair: tuple[DataConn, socket.socket], seed: int, into: bool) -> None:
    conn, server = pair
    data, expected = _wire(seed)
    writer = _send_in_pieces(server, data, seed)
    targets = [memoryview(bytearray(size + 3)) for _, size in REPLY]
    conn.targets = targets if into else None
    deadline = time.monotonic() + 30
    for i, (ftype, index, body) in enumerate(expected):
        conn.following = len(expected) - i - 1
        frame = conn.read(deadline)
        assert (frame.type, frame.header.count, bytes(frame.body)) == (ftype, index, body)
        if into and ftype == CHUNK:
            assert frame.body.obj is targets[i].obj  # landed in the caller's buffer
    writer.join()
    with pytest.raises(BlockingIOError):
        conn.sock.recv(1, socket.MSG_DONTWAIT)  # nothing read past the reply


def test_two_replies_back_to_back(pair: tuple[DataConn, socket.socket]) -> None:
    """The header read ahead belongs to the reply in progress only: a second reply sent
    at once after the first is read whole by the next request."""
    conn, server = pair
    data, expected = _wire(7)
    server.sendall(data + data)
    deadline = time.monotonic() + 30
    for _ in range(2):
        for i, (ftype, index, body) in enumerate(expected):
            conn.following = len(expected) - i - 1
            frame = conn.read(deadline)
            assert (frame.type, frame.header.count, bytes(frame.body)) == (ftype, index, body)
        conn.following = 0


def test_peer_closing_mid_body_is_an_error(pair: tuple[DataConn, socket.socket]) -> None:
    conn, server = pair
    data, _ = _wire(1)
    server.sendall(data[:1000])
    server.shutdown(socket.SHUT_WR)
    conn.following = len(REPLY) - 1
    with pytest.raises(ConnectionError):
        conn.read(time.monotonic() + 30)


def test_short_deadline_ends_a_blocked_read(pair: tuple[DataConn, socket.socket]) -> None:
    conn, server = pair
    data, _ = _wire(2)
    server.sendall(data[:40_000])  # the first body is 70 000 bytes: the read cannot complete
    conn.following = len(REPLY) - 1
    with pytest.raises(OSError):  # SO_RCVTIMEO: EAGAIN once the deadline passes
        conn.read(time.monotonic() + 0.3)


def _expected_results(expected: list[tuple[int, int, bytes]]) -> list[bytes | str]:
    return [body if ftype == CHUNK else body.decode() for ftype, _, body in expected]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("into", [True, False])
def test_read_reply_reads_the_whole_reply_exactly(pair: tuple[DataConn, socket.socket], seed: int,
                                                  into: bool) -> None:
    """The lean loop the data path uses on plain TCP: the same reply in the same awkward
    pieces gives every chunk (fresh bytes, or its length in the caller's buffer) and every
    miss reason, and reads nothing past the reply."""
    conn, server = pair
    data, expected = _wire(seed)
    writer = _send_in_pieces(server, data, seed)
    targets = [memoryview(bytearray(size + 3)) for _, size in REPLY]
    results, error = conn.read_reply(len(REPLY), targets if into else None, time.monotonic() + 30)
    writer.join()
    assert error is None
    want = _expected_results(expected)
    if into:
        got = [bytes(targets[i][: r]) if isinstance(r, int) else r for i, r in enumerate(results)]
        assert got == want
    else:
        assert results == want
        assert all(type(r) is bytes for r in results if not isinstance(r, str))
    with pytest.raises(BlockingIOError):
        conn.sock.recv(1, socket.MSG_DONTWAIT)


def test_read_reply_error_frame_refuses_the_request(pair: tuple[DataConn, socket.socket]) -> None:
    conn, server = pair
    server.sendall(b"".join(bytes(p) for p in encode_error(5, "not here")))
    assert conn.read_reply(3, None, time.monotonic() + 30) == ([], (5, "not here"))


@pytest.mark.parametrize("bad, message", [
    (lambda: encode_chunk(1, b"x"), "reply for index 1, expected 0"),
    (lambda: [encode_header(PUT_REPLY, 0, 0, 0)], "expected CHUNK or MISS, got PUT_REPLY"),
    (lambda: [b"XX" + encode_header(CHUNK, 0, 0, 0)[2:]], "bad frame magic"),
    (lambda: [encode_header(CHUNK, 0x80, 0, 0)], "unknown frame flags"),
    (lambda: [encode_header(MISS, 0, 0, 1 << 20)], "exceeds"),
    (lambda: [encode_header(MISS, 0, 0, 2), b"\xff\xfe"], "MISS body is not UTF-8"),
])
def test_read_reply_is_strict(pair: tuple[DataConn, socket.socket], bad: Callable[[], list[bytes]],
                              message: str) -> None:
    conn, server = pair
    server.sendall(b"".join(bytes(p) for p in bad()))
    with pytest.raises(ProtocolError, match=message):
        conn.read_reply(2, None, time.monotonic() + 30)


def test_read_reply_error_after_a_chunk_is_a_protocol_error(pair: tuple[DataConn, socket.socket]) -> None:
    conn, server = pair
    server.sendall(b"".join(bytes(p) for p in [*encode_chunk(0, b"abc"), *encode_error(5, "late")]))
    with pytest.raises(ProtocolError, match="expected CHUNK or MISS, got ERROR"):
        conn.read_reply(2, None, time.monotonic() + 30)


def test_read_reply_small_target_is_drained_then_noted(pair: tuple[DataConn, socket.socket]) -> None:
    """A chunk larger than its buffer is read off the socket (the next request finds a clean
    connection) and noted in ``overflow``; the chunks after it still land."""
    conn, server = pair
    server.sendall(b"".join(bytes(p) for p in [*encode_chunk(0, b"a" * 100), *encode_chunk(1, b"b" * 10)]))
    targets = [memoryview(bytearray(50)), memoryview(bytearray(10))]
    results, error = conn.read_reply(2, targets, time.monotonic() + 30)
    assert error is None and conn.overflow == {0: 100}
    assert results[1] == 10 and bytes(targets[1]) == b"b" * 10
    with pytest.raises(BlockingIOError):
        conn.sock.recv(1, socket.MSG_DONTWAIT)


def test_read_reply_peer_closing_mid_reply_is_an_error(pair: tuple[DataConn, socket.socket]) -> None:
    conn, server = pair
    data, _ = _wire(3)
    server.sendall(data[:1000])
    server.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError):
        conn.read_reply(len(REPLY), None, time.monotonic() + 30)


def test_read_reply_short_deadline_ends_a_blocked_read(pair: tuple[DataConn, socket.socket]) -> None:
    conn, server = pair
    data, _ = _wire(2)
    server.sendall(data[:40_000])
    with pytest.raises(OSError):  # SO_RCVTIMEO: EAGAIN once the deadline passes
        conn.read_reply(len(REPLY), None, time.monotonic() + 0.3)

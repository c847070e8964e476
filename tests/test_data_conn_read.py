"""The data path client's frame reads over a real socket: one MSG_WAITALL call per body and,
inside a GET reply, the next frame's header read together with the current body. The
server side is a socketpair end that writes real frames in awkward pieces (a header split
across writes, a body and the next header in one write), so every way the bytes can arrive
is taken; the frames read must be exactly the frames written."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kvtier.protocol.frames import CHUNK, MISS, WireLimits, encode_chunk, encode_miss
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


@pytest.fixture
def pair() -> Iterator[tuple[DataConn, socket.socket]]:
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

    def write() -> None:
        for piece in _cuts(data, seed):
            server.sendall(piece)
            if len(piece) < 64:
                time.sleep(0.001)  # let the reader block on a partial header

    writer = threading.Thread(target=write)
    writer.start()
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

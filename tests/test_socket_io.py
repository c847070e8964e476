"""kvtier.protocol.socket_io.send_all: every byte in order, through short writes, over a real
socket pair (a small send buffer and a slow reader force partial sendmsg calls)."""

from __future__ import annotations

import socket
import threading

import numpy as np

from kvtier.protocol.socket_io import send_all


def _drain(sock: socket.socket, total: int, out: bytearray) -> None:
    while len(out) < total:
        data = sock.recv(3000)  # small reads: the writer keeps finding its buffer full
        if not data:
            return
        out += data


def _send_and_receive(parts: list) -> tuple[int, bytes]:
    a, b = socket.socketpair()
    try:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        expected = sum(memoryview(p).nbytes for p in parts)
        got = bytearray()
        reader = threading.Thread(target=_drain, args=(b, expected, got))
        reader.start()
        sent = send_all(a, parts)
        reader.join(30)
        return sent, bytes(got)
    finally:
        a.close()
        b.close()


def test_mixed_parts_arrive_whole_and_in_order_through_short_writes() -> None:
    rng = np.random.default_rng(0)
    floats = rng.standard_normal(50_000).astype(np.float32)  # itemsize 4: len() != bytes
    parts = [b"head", b"", bytearray(rng.integers(0, 255, 70_000, dtype=np.uint8).tobytes()),
             memoryview(floats), memoryview(b"")[0:0], b"x" * 100_001, memoryview(bytearray(b"tail"))]
    sent, got = _send_and_receive(parts)
    want = b"".join(memoryview(p).cast("B").tobytes() for p in parts)
    assert sent == len(want) == len(got)
    assert got == want


def test_more_parts_than_one_sendmsg_takes() -> None:
    parts = [bytes([i % 251]) * (i % 7 + 1) for i in range(1500)]  # over the 512-buffer batches
    sent, got = _send_and_receive(parts)
    assert sent == len(got) and got == b"".join(parts)


def test_nothing_to_send() -> None:
    assert _send_and_receive([]) == (0, b"")
    assert _send_and_receive([b"", b""]) == (0, b"")

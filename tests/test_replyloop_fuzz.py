"""Differential fuzz of the data path client's GET reply reader: kvtier/_replyloop.c (the C loop
over runs of CHUNK frames) and read_reply's Python loop alone must give the same answer for
the same bytes from a server, valid or not: the same results and buffers, or the same error
type and message. Replies are real frames (chunks, misses, shared-memory references, ERROR),
then mutated (a header byte changed, a length or index rewritten, the stream cut short) and
sent over a real TCP socket in awkward pieces; the sender then closes, so nothing can hang."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import pytest

from kvtier.protocol.frames import (
    WireLimits,
    encode_chunk,
    encode_chunk_ref,
    encode_error,
    encode_miss,
)
from kvtier.tiers.remote import data_conn
from kvtier.tiers.remote.data_conn import DataConn

LIMITS = WireLimits(max_chunk_bytes=1 << 20, max_batch_keys=64)


def _reply(rng: random.Random) -> tuple[int, bytes]:
    """(keys asked, reply bytes): mostly valid frames, then zero to three mutations."""
    n = rng.randint(1, 8)
    parts: list[Any] = []
    for i in range(n):
        kind = rng.choices(["chunk", "miss", "ref", "error"], [8, 2, 1, 0.3])[0]
        if kind == "chunk":
            parts += encode_chunk(i, rng.randbytes(rng.choice([0, 1, 15, 16, 17, 4096, 70_000])))
        elif kind == "miss":
            parts += encode_miss(i, rng.choice(["absent", "corrupt", "x" * 40]))
        elif kind == "ref":
            parts += encode_chunk_ref(i, 0, 10)
        else:
            parts += encode_error(rng.randint(1, 16), "refused")
    data = bytearray(b"".join(bytes(p) for p in parts))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        op = rng.randrange(4)
        if not data:
            break
        if op == 0:  # any byte
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif op == 1:  # a header field of the first frames (type, flags, index, length)
            at = rng.choice([2, 3, 4, 8, 9, 12, 15])
            if at < len(data):
                data[at] = rng.randrange(256)
        elif op == 2:  # cut short
            del data[rng.randrange(len(data)) :]
        else:  # extra bytes after the reply
            data += rng.randbytes(rng.randint(1, 40))
    return n, bytes(data)


def _outcome(data: bytes, n: int, into: bool, seed: int) -> tuple[Any, ...]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    client.settimeout(None)
    conn = DataConn(client, LIMITS)
    rng, pieces = random.Random(seed), random.Random(seed + 1)  # (the sender has its own)

    def send() -> None:
        pos = 0
        try:
            while pos < len(data):
                k = pieces.choice([1, 9, 16, 33, 4096, 100_000])
                server.sendall(data[pos : pos + k])
                pos += k
            server.shutdown(socket.SHUT_WR)
        except OSError:  # the reader gave up and closed
            pass

    writer = threading.Thread(target=send)
    writer.start()
    targets = [memoryview(bytearray(rng.choice([8, 4096, 80_000]))) for _ in range(n)] if into else None
    try:
        results, error = conn.read_reply(n, targets, time.monotonic() + 10)
        buffers = [bytes(t) for t in targets] if targets is not None else None
        out: tuple[Any, ...] = ("ok", results, error, dict(conn.overflow), buffers)
    except Exception as exc:  # noqa: BLE001 - the outcome under test is which exception, exactly
        out = ("raised", type(exc).__name__, str(exc))
    finally:
        conn.close()
        writer.join()
        server.close()
    return out


def require_c_loop() -> None:
    """Skip where kvtier._replyloop is not built; CI builds it (same machine image: gcc), so
    there it is a failure."""
    if data_conn.C_RECV_CHUNKS is None:
        assert not os.environ.get("CI"), "kvtier._replyloop was not built: pip install -e . with a C compiler"
        pytest.skip("kvtier._replyloop not built here (optional accelerator)")


def check_loops_agree(n: int, data: bytes, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C loop and the Python loop alone give the same :func:`_outcome` for ``data``
    (odd seeds read into caller buffers)."""
    require_c_loop()
    into = seed % 2 == 1
    with_c = _outcome(data, n, into, seed)
    monkeypatch.setattr(data_conn, "C_RECV_CHUNKS", None)
    assert _outcome(data, n, into, seed) == with_c


def test_c_loop_was_built_with_the_wire_constants() -> None:
    require_c_loop()
    from kvtier import _replyloop
    from kvtier.protocol.frames import CHUNK, HEADER_SIZE

    assert (_replyloop.HEADER_SIZE, _replyloop.CHUNK_TYPE) == (HEADER_SIZE, CHUNK)
    assert _replyloop.REARM_S == data_conn._REARM_S


@pytest.mark.parametrize("seed", range(160))
def test_c_and_python_loops_agree(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    check_loops_agree(*_reply(random.Random(seed)), seed, monkeypatch)

"""The data path receives a PUT's chunk straight into a free RAM slot reserved for it and
publishes it only once verified (kvtier.server.dataplane's _DirectPut): a refused chunk never
becomes visible and never replaces the key's old chunk, and neither a refused nor a cut-off
PUT costs a slot. A real kvtier-server process over a real socket."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.protocol.frames import (
    CHUNK,
    PUT_REPLY,
    FrameReader,
    WireLimits,
    encode_get,
    encode_hello,
    encode_put,
    parse_put_reply,
)
from kvtier.protocol.socket_io import read_frame, send_all
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

SLOTS = 8
CHUNK_BYTES = 100_000
LIMITS = WireLimits(1 << 20, 64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("direct-put"), "--cpu-bytes", f"{SLOTS * 128}KiB",
                     "--slot-bytes", "128KiB", "--set", "max_chunk_bytes=1MiB",
                     "--set", "cpu.policy=lru")  # LRU: a fresh batch evicts the older chunks first
    yield s
    assert s.alive(), s.log
    assert s.stop() == 0, s.log
    assert "Traceback" not in s.log, s.log


def connect(server: ServerProc) -> tuple[socket.socket, FrameReader]:
    sock = socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=10)
    reader = FrameReader(LIMITS)
    send_all(sock, encode_hello(""))
    read_frame(sock, reader)  # WELCOME
    return sock, reader


def put_batch(sock: socket.socket, reader: FrameReader, items: list[tuple[bytes, bytes]]) -> list[bool] | bytes:
    parts: list = []
    for i, (key, chunk) in enumerate(items):
        parts += encode_put(key, chunk, more=i < len(items) - 1)
    send_all(sock, parts)
    frame = read_frame(sock, reader)
    return parse_put_reply(frame, len(items)) if frame.type == PUT_REPLY else bytes(frame.body)


def get_all(sock: socket.socket, reader: FrameReader, keys: list[bytes]) -> list[bytes | None]:
    send_all(sock, encode_get(keys))
    out: list[bytes | None] = []
    for _ in keys:  # a body views the reader's buffer until the next frame: copy it now
        frame = read_frame(sock, reader)
        out.append(bytes(frame.body) if frame.type == CHUNK else None)
    return out


def test_refused_and_cut_off_puts_cost_nothing(server: ServerProc) -> None:
    keys = make_keys(SLOTS + SLOTS // 2, seed=11)
    old = [make_chunk(k, CHUNK_BYTES, seed=i) for i, k in enumerate(keys[: SLOTS // 2])]
    sock, reader = connect(server)
    with sock:
        assert put_batch(sock, reader, list(zip(keys, old))) == [True] * len(old)
        # A corrupt rewrite of key 0 lands in a free slot, fails its checksum: refused, and the
        # key still reads its old chunk (the bad bytes were never published).
        bad = bytearray(make_chunk(keys[0], CHUNK_BYTES, seed=99))
        bad[-1] ^= 0xFF
        new1 = make_chunk(keys[1], CHUNK_BYTES, seed=98)  # an existing key's rewrite stays stored
        refused = put_batch(sock, reader, [(keys[1], new1), (keys[0], bytes(bad))])  # (as on gRPC)
        assert isinstance(refused, bytes) and b"checksum" in refused
        assert get_all(sock, reader, keys[: len(old)]) == [old[0], new1, *old[2:]]
    # PUTs cut off mid-chunk, each on its own connection: the server's thread sees EOF and
    # gives the reserved slot back before it closes its end.
    for i in range(3 * SLOTS):
        cut, _ = connect(server)
        with cut:
            whole = b"".join(bytes(p) for p in encode_put(keys[2], make_chunk(keys[2], CHUNK_BYTES, seed=i)))
            cut.sendall(whole[: len(whole) // 2])
            cut.shutdown(socket.SHUT_WR)
            assert cut.recv(1) == b""  # the server ended the connection
    sock, reader = connect(server)
    with sock:
        assert get_all(sock, reader, keys[: len(old)]) == [old[0], new1, *old[2:]]
        # Every slot is still usable: SLOTS fresh chunks all stay resident together (a lost slot
        # would have evicted one of them).
        fresh = [make_chunk(k, CHUNK_BYTES, seed=50 + i) for i, k in enumerate(keys[-SLOTS:])]
        assert put_batch(sock, reader, list(zip(keys[-SLOTS:], fresh))) == [True] * SLOTS
        assert get_all(sock, reader, keys[-SLOTS:]) == fresh


def fill_refuse_and_refill(server: ServerProc, slots: int, chunk_bytes: int, seed: int, refusals: int) -> None:
    """On an LRU server with RAM for ``slots`` chunks: fill it, send ``refusals`` corrupt
    chunks (each refused, evicting nothing), then as many new chunks as it holds (all
    stored, the first ones evicted)."""
    keys = make_keys(2 * slots, seed=seed)
    chunks = [make_chunk(k, chunk_bytes, seed=i) for i, k in enumerate(keys)]
    sock, reader = connect(server)
    with sock:
        assert put_batch(sock, reader, list(zip(keys[:slots], chunks[:slots]))) == [True] * slots
        for _ in range(refusals):
            bad = bytearray(chunks[slots])
            bad[-1] ^= 0xFF
            assert isinstance(put_batch(sock, reader, [(keys[slots], bytes(bad))]), bytes)
        assert get_all(sock, reader, keys[:slots]) == chunks[:slots]  # nothing evicted for them
        assert put_batch(sock, reader, list(zip(keys[slots:], chunks[slots:]))) == [True] * slots
        assert get_all(sock, reader, keys[slots:]) == chunks[slots:]
        assert get_all(sock, reader, keys[:slots]) == [None] * slots  # evicted, oldest first


def test_a_put_into_a_full_ram_takes_the_copying_path(server: ServerProc) -> None:
    """No free slot (too few slots for spares): the chunk is verified first and then evicts
    (a reservation never does)."""
    fill_refuse_and_refill(server, SLOTS, CHUNK_BYTES, seed=12, refusals=1)


def test_a_put_trickled_in_pieces_arrives_whole(server: ServerProc) -> None:
    """The server reads each frame part with one blocking MSG_WAITALL call: a body that
    arrives in odd pieces with pauses (header split, chunk split mid-page) must still come
    out whole, and the next request on the connection must be read from the right place."""
    keys = make_keys(2, seed=23)
    chunks = [make_chunk(k, CHUNK_BYTES, seed=40 + i) for i, k in enumerate(keys)]
    sock, reader = connect(server)
    with sock:
        parts: list = []
        for i, (key, chunk) in enumerate(zip(keys, chunks)):
            parts += encode_put(key, chunk, more=i == 0)
        wire = b"".join(bytes(p) for p in parts)
        cuts = sorted({0, 7, 16, 40, 5_000, CHUNK_BYTES // 2, 65_537, CHUNK_BYTES + 70, len(wire) - 3, len(wire)})
        for a, b in zip(cuts, cuts[1:]):
            sock.sendall(wire[a:b])
            time.sleep(0.02)  # each piece is its own segment: a plain recv would return short
        frame = read_frame(sock, reader)
        assert frame.type == PUT_REPLY and parse_put_reply(frame, 2) == [True, True]
        assert get_all(sock, reader, keys) == chunks


def test_a_body_with_no_slot_lands_in_the_connection_scratch(tmp_path: Path) -> None:
    """In process: with a disk tier below RAM no slot is reserved, and the body goes into the
    connection's scratch buffer (``spill``) instead of growing the frame reader's own buffer,
    which then stayed a second max_chunk_bytes for the connection's life; a refused batch's
    bodies are drained there too; a body larger than the scratch is the reader's affair."""
    from kvtier.config import CpuTierConfig, DiskTierConfig
    from kvtier.protocol.frames import PARENT, PUT, SHM, FrameHeader
    from kvtier.server.auth import Authenticator
    from kvtier.server.put_run import DirectPut
    from kvtier.server.storage import Storage

    auth = Authenticator.from_file("")
    storage = Storage(auth.tenants.values(), CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=128 << 10),
                      DiskTierConfig(enabled=True, path=str(tmp_path), capacity_bytes=8 << 20))
    try:
        spill = memoryview(bytearray(128 << 10))
        direct = DirectPut(next(iter(storage.stores.values())), spill)
        target = direct.target(FrameHeader(PUT, 0, 0, 32 + 100_000))
        assert target is not None and target[0].nbytes == 32
        assert target[1].obj is spill.obj and target[1].nbytes == 100_000  # the chunk at its start
        assert direct.take() is None
        direct.refusing = True
        target = direct.target(FrameHeader(PUT, PARENT, 0, 64 + 5000))
        assert target is not None and target[1].obj is spill.obj
        assert direct.target(FrameHeader(PUT, 0, 0, 32 + spill.nbytes + 1)) is None
        assert direct.target(FrameHeader(PUT, SHM, 0, 48)) is None  # a reference: no chunk body
    finally:
        storage.close()

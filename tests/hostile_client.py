"""A hostile client's toolkit for kvtier-server's data port (tests): a server with small
limits and two tenants, and the wire protocol spoken by hand — HELLO, the shared-memory offer
and its descriptor hand-off, PUT/GET by reference.

Used by tests/test_server_hostile.py (connections and handshakes) and
tests/test_server_hostile_shm.py (the shared-memory rules). Each module that imports the
``server`` fixture gets its own server (module scope).
"""

from __future__ import annotations

import mmap
import os
import socket
from collections.abc import Iterator

import pytest

from kvtier.protocol.frames import (
    ARENA,
    CHUNK,
    PUT_REPLY,
    SHM,
    SHM_READY,
    WELCOME,
    FrameReader,
    ShmOffer,
    WireLimits,
    encode_get,
    encode_hello,
    encode_put,
    encode_shm_open,
    parse_ref,
    parse_shm_ready,
)
from kvtier.protocol.socket_io import read_frame, send_all
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
LIMITS = WireLimits(1 << 20, 64)


@pytest.fixture(scope="module", name="server")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("hostile")
    tokens = work / "tokens"
    tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
    tokens.chmod(0o600)
    s = start_server(work, "--tokens-file", str(tokens), "--set", "max_chunk_bytes=1MiB",
                     "--set", "max_batch_keys=64", "--set", "shm_bytes=4MiB",
                     "--set", "max_data_connections=16", "--set", "max_unauthenticated_connections=4",
                     "--set", "max_data_connections_per_tenant=4",
                     "--set", "handshake_timeout_s=1.5")
    yield s
    assert s.alive(), f"the server died: {s.proc.returncode}\n{s.log}"
    assert s.stop() == 0, s.log
    assert "Traceback" not in s.log, s.log


def connect(server: ServerProc, token: str = ALICE) -> tuple[socket.socket, FrameReader]:
    sock = socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=10)
    reader = FrameReader(LIMITS)
    send_all(sock, encode_hello(token))
    assert read_frame(sock, reader).type == WELCOME
    return sock, reader


def offer_segment(sock: socket.socket, reader: FrameReader) -> ShmOffer:
    send_all(sock, encode_shm_open())
    frame = read_frame(sock, reader)
    assert frame.type == SHM_READY, bytes(frame.body)
    return parse_shm_ready(frame)


def fetch_fds(offer: ShmOffer, ticket: str | None = None) -> list[int]:
    """Every descriptor the hand-off gives, as a client gets them (the segment's, then the
    arena's where one is offered); none when the server gives none."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(5)
        unix.connect("\0" + offer.socket)
        unix.sendall((offer.ticket if ticket is None else ticket).encode())
        try:
            _, fds, _, _ = socket.recv_fds(unix, 1, 2)
        except ConnectionResetError:
            return []
    return list(fds)


def fetch_fd(offer: ShmOffer, ticket: str | None = None) -> int | None:
    """The segment's descriptor as a client gets it, or None when the server gives none (an
    arena's, also given, is closed)."""
    fds = fetch_fds(offer, ticket)
    for extra in fds[1:]:
        os.close(extra)
    return fds[0] if fds else None


def shm_names(server: ServerProc) -> list[str]:
    """Names in /dev/shm that this server made (the old code named them kvtier-<pid>-...)."""
    return [n for n in os.listdir("/dev/shm") if n.startswith(f"kvtier-{server.proc.pid}-")]


def alive_and_serving(server: ServerProc) -> None:
    assert server.alive(), f"server exited with {server.proc.returncode}\n{server.log}"
    sock, reader = connect(server, BOB)
    with sock:
        key = make_keys(1, seed=99)[0]
        send_all(sock, encode_put(key, make_chunk(key, 2000)))
        assert read_frame(sock, reader).type == PUT_REPLY


def assert_shm_get(sock: socket.socket, reader: FrameReader, seg: mmap.mmap, keys: list[bytes],
                   chunks: list[bytes]) -> None:
    """GET ``keys``: each reply is a reference into ``seg`` where the server wrote its chunk."""
    send_all(sock, encode_get(keys))
    for chunk in chunks:
        frame = read_frame(sock, reader)
        assert frame.type == CHUNK and frame.header.flags & SHM and not frame.header.flags & ARENA
        ref = parse_ref(frame.body, "CHUNK")
        assert seg[ref.offset : ref.offset + ref.length] == chunk

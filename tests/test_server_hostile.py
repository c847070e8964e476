"""kvtier-server against a hostile client of its data port: a tenant with a valid token that
breaks the shared-memory rules, and peers with no token at all that try to pin memory or
connection slots. Each case is one of issue 10's reproductions; the server must stay up,
serve other clients, and give away nothing it should not.

Real kvtier-server processes on loopback; the attacker speaks the wire protocol by hand.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.protocol.frames import (
    CHUNK,
    ERROR,
    PUT,
    PUT_REPLY,
    SHM,
    SHM_READY,
    WELCOME,
    FrameReader,
    ShmOffer,
    WireLimits,
    encode_get,
    encode_header,
    encode_hello,
    encode_put,
    encode_put_ref,
    encode_shm_mapped,
    encode_shm_open,
    parse_ref,
    parse_shm_ready,
)
from kvtier.protocol.socket_io import read_frame, send_all
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef00"
LIMITS = WireLimits(1 << 20, 64)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
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


def fetch_fd(offer: ShmOffer, ticket: str | None = None) -> int | None:
    """The segment's descriptor as a client gets it, or None when the server gives none."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(5)
        unix.connect("\0" + offer.socket)
        unix.sendall((offer.ticket if ticket is None else ticket).encode())
        try:
            _, fds, _, _ = socket.recv_fds(unix, 1, 1)
        except ConnectionResetError:
            return None
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
        assert frame.type == CHUNK and frame.header.flags & SHM
        ref = parse_ref(frame.body, "CHUNK")
        assert seg[ref.offset : ref.offset + ref.length] == chunk


def test_client_cannot_shrink_or_grow_its_segment(server: ServerProc) -> None:
    """Issue 10 item 1: ftruncate of the segment used to SIGBUS the server. The descriptor a
    client gets is sealed: truncation fails, and the server's copies stay safe."""
    sock, reader = connect(server)
    with sock:
        offer = offer_segment(sock, reader)
        fd = fetch_fd(offer)
        assert fd is not None
        try:
            for size in (0, offer.size // 2, offer.size * 2):  # before SHM_MAPPED
                with pytest.raises(PermissionError):
                    os.ftruncate(fd, size)
            seg = mmap.mmap(fd, offer.size)
            send_all(sock, encode_shm_mapped(True))
            with pytest.raises(PermissionError):  # and after
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)
        key = make_keys(1, seed=1)[0]
        chunk = make_chunk(key, 3000)
        seg[: len(chunk)] = chunk
        send_all(sock, encode_put_ref(key, 0, len(chunk)))
        assert read_frame(sock, reader).type == PUT_REPLY
        seg[:4096] = b"\0" * 4096  # the server copied it: rewriting the segment changes nothing
        assert_shm_get(sock, reader, seg, [key], [chunk])
        seg.close()
    alive_and_serving(server)


def test_a_shared_memory_put_stores_what_it_verified(server: ServerProc) -> None:
    """A PUT by reference is copied out of the segment and verified as the copy it stores: a
    corrupt chunk there is refused (DATA_LOSS) and leaves the key's old chunk in place; a good
    one, or several in one batch, are stored whole."""
    sock, reader = connect(server)
    with sock:
        offer = offer_segment(sock, reader)
        fd = fetch_fd(offer)
        assert fd is not None
        seg = mmap.mmap(fd, offer.size)
        os.close(fd)
        send_all(sock, encode_shm_mapped(True))
        keys = make_keys(3, seed=41)
        chunks = [make_chunk(k, 300_000 + i, seed=i) for i, k in enumerate(keys)]
        at = 0
        for i, (key, chunk) in enumerate(zip(keys, chunks)):
            seg[at : at + len(chunk)] = chunk
            send_all(sock, encode_put_ref(key, at, len(chunk), more=i < 2))
            at += len(chunk)
        assert read_frame(sock, reader).type == PUT_REPLY
        bad = bytearray(make_chunk(keys[0], 300_000, seed=9))
        bad[-1] ^= 1
        seg[: len(bad)] = bad
        send_all(sock, encode_put_ref(keys[0], 0, len(bad)))
        frame = read_frame(sock, reader)
        assert frame.type == ERROR and b"checksum" in bytes(frame.body)
        assert_shm_get(sock, reader, seg, keys, chunks)
        seg.close()
    alive_and_serving(server)


def test_rule_breaker_loses_only_its_connection(server: ServerProc) -> None:
    """References past the segment, a segment asked for twice: that connection gets an
    ERROR and is closed; another tenant's connection in the middle of its work is untouched."""
    other, other_reader = connect(server, BOB)
    sock, reader = connect(server)
    with sock, other:
        offer = offer_segment(sock, reader)
        fd = fetch_fd(offer)
        assert fd is not None
        os.close(fd)
        send_all(sock, encode_shm_mapped(True))
        send_all(sock, encode_put_ref(make_keys(1, seed=2)[0], offer.size - 10, 4096))
        frame = read_frame(sock, reader)
        assert frame.type == ERROR and b"outside any mapped segment" in bytes(frame.body)
        key = make_keys(1, seed=3)[0]
        send_all(other, encode_put(key, make_chunk(key, 1000)))
        assert read_frame(other, other_reader).type == PUT_REPLY
    alive_and_serving(server)


def test_no_segment_is_ever_named_or_given_to_a_stranger(server: ServerProc) -> None:
    """Item 4: nothing appears in /dev/shm; the hand-off socket gives the descriptor only for
    the ticket (which travels on the authenticated connection), once."""
    sock, reader = connect(server)
    with sock:
        offer = offer_segment(sock, reader)
        assert not shm_names(server)
        assert fetch_fd(offer, ticket="0" * len(offer.ticket)) is None  # a stranger: nothing
        fd = fetch_fd(offer)
        assert fd is not None
        os.close(fd)
        try:  # one hand-off, then the socket is gone (or closing: no second descriptor)
            again = fetch_fd(offer)
        except ConnectionRefusedError:
            again = None
        assert again is None
        send_all(sock, encode_shm_mapped(True))
        send_all(sock, encode_get(make_keys(1, seed=4)))
        assert read_frame(sock, reader).type != ERROR
    alive_and_serving(server)


def test_unanswered_offer_does_not_stall_or_leak(tmp_path: Path) -> None:
    """A client that never fetches the fd: the server gives up after its hand-off time; a
    kill -9 with an offer pending leaves nothing in /dev/shm (item 7)."""
    s = start_server(tmp_path)
    try:
        sock, reader = connect(s, "")
        with sock:
            offer_segment(sock, reader)
            send_all(sock, encode_shm_mapped(False))  # declined: the server moves on at once
            start = time.monotonic()
            send_all(sock, encode_get(make_keys(1, seed=5)))
            assert read_frame(sock, reader).type != ERROR
            assert time.monotonic() - start < 2
        sock, reader = connect(s, "")
        offer_segment(sock, reader)
        s.kill()
        sock.close()
        assert not shm_names(s)
    finally:
        s.kill()


def _closed_within(sock: socket.socket, seconds: float) -> float:
    """Seconds until the server ends the connection (reading and dropping what it sends)."""
    start = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - start


def test_no_large_frame_before_authentication(server: ServerProc) -> None:
    """Item 2: a header announcing a PUT-sized body before HELLO is refused at once (nothing
    allocated for it), as is a HELLO longer than any token."""
    for frame in (encode_header(PUT, 0, 0, 1 << 20), encode_header(1, 0, 1, 1 << 16)):
        with socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=5) as sock:
            sock.sendall(frame)
            reader = FrameReader(LIMITS)
            reply = read_frame(sock, reader)
            assert reply.type == ERROR and b"exceeds" in bytes(reply.body), bytes(reply.body)
            assert _closed_within(sock, 5) < 1
    alive_and_serving(server)


def test_handshake_is_a_deadline_not_a_per_read_timeout(server: ServerProc) -> None:
    """Item 2: a peer trickling its HELLO a byte at a time is cut off at handshake_timeout_s."""
    hello = b"".join(bytes(p) for p in encode_hello(ALICE))
    with socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=10) as sock:
        start = time.monotonic()
        for b in hello:
            try:
                sock.send(bytes([b]))
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.25)
            if time.monotonic() - start > 6:
                break
        left = _closed_within(sock, 5)
        assert time.monotonic() - start - left < 3.0  # 1.5 s deadline + reaper tick + slack
    alive_and_serving(server)


def test_tokenless_peers_cannot_take_the_slots(server: ServerProc) -> None:
    """Item 3: more bare connections than max_data_connections (16), all trickling; a real
    tenant still connects and works, and the bare ones hold at most their own small cap."""
    bare = [socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=5) for _ in range(24)]
    try:
        for s in bare:
            s.send(b"K")
        time.sleep(0.3)
        sock, reader = connect(server)
        with sock:
            key = make_keys(1, seed=6)[0]
            send_all(sock, encode_put(key, make_chunk(key, 1000)))
            assert read_frame(sock, reader).type == PUT_REPLY
        open_ = 0
        for s in bare:  # pushed out (oldest first) or cut at the deadline
            s.setblocking(False)
            try:
                open_ += s.recv(1) != b""
            except BlockingIOError:
                open_ += 1
            except ConnectionResetError:
                pass
        assert open_ <= 4
    finally:
        for s in bare:
            s.close()
    alive_and_serving(server)


def test_one_tenant_cannot_take_every_connection(server: ServerProc) -> None:
    """Item 7: each connection holds a segment and a scratch buffer no quota counts; one
    tenant gets at most max_data_connections_per_tenant (4 here) of them, others still connect."""
    held: list[socket.socket] = []
    try:
        end = time.monotonic() + 10
        while len(held) < 4 and time.monotonic() < end:  # earlier tests' connections may linger
            sock = socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=5)
            send_all(sock, encode_hello(ALICE))
            frame = read_frame(sock, FrameReader(LIMITS))
            if frame.type == WELCOME:
                held.append(sock)
            else:
                sock.close()
                time.sleep(0.1)
        assert len(held) == 4
        with socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=5) as sock:
            send_all(sock, encode_hello(ALICE))
            frame = read_frame(sock, FrameReader(LIMITS))
            assert frame.type == ERROR and b"max_data_connections_per_tenant=4" in bytes(frame.body)
        alive_and_serving(server)  # bob
    finally:
        for sock in held:
            sock.close()


def test_ticket_errors_are_no_crash(server: ServerProc) -> None:
    """Garbage on the hand-off socket: wrong length, nothing at all, a hang-up."""
    sock, reader = connect(server)
    with sock:
        offer = offer_segment(sock, reader)
        for junk in (b"", b"x", b"y" * 1000):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
                unix.settimeout(5)
                unix.connect("\0" + offer.socket)
                if junk:
                    try:
                        unix.sendall(junk)
                    except OSError as exc:
                        assert exc.errno in (errno.EPIPE, errno.ECONNRESET)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:  # connects, says nothing
            silent.connect("\0" + offer.socket)
            start = time.monotonic()
            fd = fetch_fd(offer)  # the real client is served right after the stranger's short wait
            assert fd is not None and time.monotonic() - start < 1.0
        os.close(fd)
        send_all(sock, encode_shm_mapped(True))
    alive_and_serving(server)


def _lying_peer(docs: list[bytes]) -> tuple[socket.socket, threading.Thread]:
    """A peer HTTP port that answers each request with the next of ``docs`` as /api/stats."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def serve() -> None:
        for body in docs:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return sock, thread


def test_one_lying_peer_does_not_break_the_cluster_page(tmp_path: Path) -> None:
    """Item 8: a peer whose /api/stats has ``"used_bytes": "lots"`` or a tier without a name
    used to make /api/cluster close with 0 bytes; now that peer is shown down, with why."""
    tier = {"name": "cpu", "used_bytes": 1, "capacity_bytes": 2, "entries": 1}
    docs = [{"node_id": "liar", "tenants": [{"tenant": "t", "used_bytes": "lots", "tiers": [tier]}]},
            {"node_id": "liar", "tenants": [{"tenant": "t", "tiers": [{"used_bytes": 1}]}]},
            {"node_id": "liar", "tenants": [{"tenant": "t", "lookup": ["x"], "tiers": []}]},
            {"node_id": "liar", "tenants": [{"tenant": "t", "tiers": [{**tier, "evictions": {"x": "y"}}]}]}]
    peer, thread = _lying_peer([json.dumps(d).encode() for d in docs])
    s = start_server(tmp_path, "--peers", f"127.0.0.1:{peer.getsockname()[1]}")
    try:
        for _ in docs:
            with urllib.request.urlopen(s.http + "/api/cluster", timeout=10) as r:
                doc = json.loads(r.read())
            assert [n["up"] for n in doc["nodes"]] == [True, False], doc["nodes"]
            assert doc["nodes"][1]["error"].startswith("bad stats document"), doc["nodes"][1]
    finally:
        peer.close()
        assert s.stop() == 0, s.log

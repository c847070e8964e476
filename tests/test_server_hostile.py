"""kvtier-server against hostile peers of its data and HTTP ports: peers with no token that
try to pin memory or connection slots (oversized frames before HELLO, a HELLO trickled a byte
at a time, more bare connections than slots), one tenant taking every connection, and a peer
node whose stats document lies. Each case is one of issue 10's reproductions; the server must
stay up, serve other clients, and give away nothing it should not. The shared-memory rules
have their own file (tests/test_server_hostile_shm.py).

Real kvtier-server processes on loopback; the attacker speaks the wire protocol by hand
(tests/hostile_client.py).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.protocol.frames import (
    ERROR,
    PUT,
    PUT_REPLY,
    WELCOME,
    FrameReader,
    encode_header,
    encode_hello,
    encode_put,
)
from kvtier.protocol.socket_io import read_frame, send_all
from tests.hostile_client import (  # noqa: F401 (hostile_server: the "server" fixture)
    ALICE,
    LIMITS,
    alive_and_serving,
    connect,
    hostile_server,
)
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server


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


def _set_soft_nofile(pid: int, soft: int) -> None:
    subprocess.run(["prlimit", "--pid", str(pid), f"--nofile={soft}:"], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs util-linux prlimit")
def test_out_of_descriptors_stalls_new_connections_and_never_ends_the_data_plane(tmp_path: Path) -> None:
    """A flood of idle connections (here on the HTTP port) can use up the process's open-files
    limit; accept() on the data port then fails with EMFILE. The data plane must wait and
    accept again once descriptors are free, never stop accepting for the rest of its life."""
    s = start_server(tmp_path)
    try:
        soft = int(subprocess.run(["prlimit", "--pid", str(s.proc.pid), "--nofile", "--raw", "--noheadings",
                                   "--output", "SOFT"], check=True, capture_output=True, text=True).stdout)
        flood: list[socket.socket] = []
        waiting = None
        try:
            _set_soft_nofile(s.proc.pid, len(os.listdir(f"/proc/{s.proc.pid}/fd")) + 2)
            for _ in range(8):  # more than the descriptors left: the rest wait in the backlog
                flood.append(socket.create_connection(("127.0.0.1", s.ports["http"]), timeout=5))
            waiting = socket.create_connection(("127.0.0.1", s.ports["data"]), timeout=10)
            end = time.monotonic() + 10  # until the data plane's accept() has met EMFILE
            while "data path: accept failed" not in s.log and time.monotonic() < end:
                time.sleep(0.05)
        finally:
            for sock in flood:
                sock.close()
            _set_soft_nofile(s.proc.pid, soft)
        assert waiting is not None
        with waiting:  # accepted once descriptors are free, and served
            send_all(waiting, encode_hello(""))
            assert read_frame(waiting, FrameReader(LIMITS)).type == WELCOME
        sock, reader = connect(s, "")
        with sock:
            key = make_keys(1, seed=8)[0]
            send_all(sock, encode_put(key, make_chunk(key, 1000)))
            assert read_frame(sock, reader).type == PUT_REPLY
        assert "data path: accept failed (Too many open files)" in s.log, s.log
    finally:
        assert s.stop() == 0, s.log


def test_idle_http_peers_cannot_hold_descriptors_or_the_port(server: ServerProc) -> None:
    """Hundreds of connections to the HTTP port that never send a request: at most
    MAX_WAITING wait at once (each new one cuts the oldest), so the process's descriptors stay
    bounded and a scraper that sends its request as it connects is answered at once."""
    from kvtier.server.http import MAX_WAITING

    fds_before = len(os.listdir(f"/proc/{server.proc.pid}/fd"))
    idle = []
    try:
        for _ in range(4 * MAX_WAITING):
            idle.append(socket.create_connection(("127.0.0.1", server.ports["http"]), timeout=5))
        end = time.monotonic() + 5  # the loop cuts the oldest as it gets to each new one
        while (held := len(os.listdir(f"/proc/{server.proc.pid}/fd")) - fds_before) > MAX_WAITING + 8 \
                and time.monotonic() < end:
            time.sleep(0.05)
        assert held <= MAX_WAITING + 8, held
        start = time.monotonic()
        with urllib.request.urlopen(server.http + "/healthz", timeout=5) as r:
            assert r.status == 200
        assert time.monotonic() - start < 2.5  # not queued behind idle peers (5 s read timeout)
    finally:
        for sock in idle:
            sock.close()
    alive_and_serving(server)

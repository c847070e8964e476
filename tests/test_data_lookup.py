"""LOOKUP on the data port against real kvtier-servers: the same answers as the gRPC Lookup
(hits, reasons, tenants), bad input refused with an ERROR, and the fallbacks: a server that
does not name the op in WELCOME (an older one) and a data path that breaks both leave the
lookup to gRPC."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.protocol.frames import (
    ERROR,
    HELLO,
    LOOKUP,
    LOOKUP_REPLY,
    OP_LOOKUP,
    WELCOME,
    FrameReader,
    ProtocolError,
    WireLimits,
    encode_error,
    encode_header,
    encode_hello,
    encode_lookup,
    encode_put,
    encode_welcome,
    parse_lookup_reply,
    parse_welcome,
    welcome_ops,
)
from kvtier.protocol.socket_io import read_frame, send_all
from kvtier.tiers.base import Entry, Probe
from kvtier.tiers.remote.data_path import SocketDataPath
from kvtier.tiers.remote.node import NodeClient
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

ALICE, BOB = "lookup-alice-0123456789abcdef", "lookup-bob-0123456789abcdef"
MAX_KEYS = 64
LIMITS = WireLimits(1 << 20, MAX_KEYS)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("lookup")
    (work / "tokens").write_text(f"{ALICE} alice\n{BOB} bob\n")
    (work / "tokens").chmod(0o600)
    # A RAM tier of 4 slots over a disk tier: lookups cross tiers and see evictions.
    s = start_server(work, "--tokens-file", str(work / "tokens"), "--cpu-bytes", "4MiB",
                     "--disk-dir", "disk", "--disk-bytes", "8MiB", "--set", f"max_batch_keys={MAX_KEYS}")
    yield s
    assert s.alive() and s.stop() == 0, s.log
    assert "Traceback" not in s.log, s.log


def node(server: ServerProc, token: str, **cfg: object) -> NodeClient:
    config = GrpcTierConfig(enabled=True, nodes=(server.address,), token=token, data_path="socket",
                            timeout_s=5.0, **cfg)  # type: ignore[arg-type]
    client = NodeClient(server.address, config, token, None)
    client.fetch_info(time.monotonic() + 5)
    return client


def deadline() -> float:
    return time.monotonic() + 5


def test_lookup_answers_as_grpc_lookup(server: ServerProc) -> None:
    alice, bob = node(server, ALICE), node(server, BOB)
    try:
        assert alice.data is not None and bob.data is not None
        assert alice.data.lookup([], deadline()) == Probe(0)
        keys = make_keys(20, seed=41)
        assert alice.put([Entry(k, make_chunk(k, 900_000, i), i) for i, k in enumerate(keys[:12])],
                         deadline()) == [True] * 12
        asks = [keys, keys[:12], keys[:5], keys[3:12], keys[12:], keys[:1], keys[12:13] + keys[:3],
                [keys[0], keys[15], keys[1]], keys[11:12] + keys[10:11]]
        reasons = set()
        for ask in asks:
            want = alice.grpc_lookup(ask, deadline())
            reasons.add(want.reason)
            assert alice.data.lookup(ask, deadline()) == want, ask
            assert alice.lookup(ask, deadline()) == want  # NodeClient.lookup: the data path
            # Another tenant's keys are invisible on both paths.
            assert bob.data.lookup(ask, deadline()) == bob.grpc_lookup(ask, deadline()) == Probe(0, "absent")
        assert reasons >= {"absent", "evicted"}  # the RAM and disk tiers evicted some of them
        # More keys than one LOOKUP takes: the run goes on across requests, as one would answer.
        present = [k for k in keys[:12] if alice.grpc_lookup([k], deadline()).hits]
        long = (present * MAX_KEYS)[: MAX_KEYS + 6] + keys[15:16]
        assert alice.data.lookup(long, deadline()) == Probe(MAX_KEYS + 6, alice.grpc_lookup(keys[15:16],
                                                                                            deadline()).reason)
        assert alice.data is not None  # no fallback happened on the way
    finally:
        alice.close()
        bob.close()


def test_lookup_is_counted_like_grpc_lookups(server: ServerProc) -> None:
    alice = node(server, ALICE)
    try:
        alice.lookup(make_keys(3, seed=43), deadline())
        text = server.metrics()
        assert 'method="data.Lookup"' in text
    finally:
        alice.close()


def _raw(server: ServerProc, token: str = ALICE) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=10)
    send_all(sock, encode_hello(token))
    frame = read_frame(sock, FrameReader(LIMITS))
    assert frame.type == WELCOME and OP_LOOKUP in welcome_ops(parse_welcome(frame))
    return sock


def _error_then_close(sock: socket.socket) -> str:
    frame = read_frame(sock, FrameReader(LIMITS))
    assert frame.type == ERROR, frame.type
    try:  # then the server hangs up (a reset when our unread bytes were still queued)
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass
    return bytes(frame.body).decode()


def test_bad_lookups_get_an_error_and_store_nothing(server: ServerProc) -> None:
    keys = make_keys(3, seed=44)
    with _raw(server) as sock:  # more keys than max_batch_keys
        send_all(sock, encode_lookup(make_keys(MAX_KEYS + 1, seed=45)))
        assert "exceeds" in _error_then_close(sock)
    with _raw(server) as sock:  # a body that does not hold count keys
        sock.sendall(encode_header(LOOKUP, 0, 2, 40) + b"k" * 40)
        assert "LOOKUP of 2 keys with a 40-byte body" in _error_then_close(sock)
    with _raw(server) as sock:  # a LOOKUP inside a PUT batch: the batch is dropped whole
        send_all(sock, encode_put(keys[0], make_chunk(keys[0]), more=True))
        send_all(sock, encode_lookup(keys))
        assert "unexpected LOOKUP" in _error_then_close(sock)
    with _raw(server) as sock:  # a reply type from a client
        sock.sendall(encode_header(LOOKUP_REPLY, 0, 0, 0))
        assert "unexpected LOOKUP_REPLY" in _error_then_close(sock)
    alice = node(server, ALICE)
    try:
        assert alice.grpc_lookup(keys[:1], deadline()) == Probe(0)  # nothing stored
        with _raw(server) as sock:  # the server is fine: a good LOOKUP on a new connection
            send_all(sock, encode_lookup(keys))
            assert parse_lookup_reply(read_frame(sock, FrameReader(LIMITS)), 3) == (0, "absent")
    finally:
        alice.close()


class OldDataPort:
    """A data port as servers before LOOKUP had it: WELCOME without ``ops``, and a frame type
    it does not know (LOOKUP) answered with an ERROR and a hang-up. Counts what it was sent."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen: list[int] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        with sock:
            reader = FrameReader(LIMITS)
            try:
                while True:
                    frame = read_frame(sock, reader)
                    self.seen.append(frame.type)
                    if frame.type != HELLO:
                        send_all(sock, encode_error(3, f"protocol error: unknown frame type {frame.type}"))
                        return
                    send_all(sock, encode_welcome({"tenant": "alice", "max_chunk_bytes": 1 << 20,
                                                   "max_batch_keys": MAX_KEYS}))
            except (ConnectionError, OSError, ProtocolError):
                return

    def close(self) -> None:
        self.listener.close()


def test_old_server_without_lookup_gets_grpc_lookups(server: ServerProc) -> None:
    alice = node(server, ALICE)
    old = OldDataPort()
    try:
        keys = make_keys(4, seed=46)
        assert alice.put([Entry(k, make_chunk(k, 1000, i), i) for i, k in enumerate(keys[:2])],
                         deadline()) == [True, True]
        assert alice.data is not None
        old_path = SocketDataPath("127.0.0.1", old.port, ALICE, None, "127.0.0.1", LIMITS, 2)
        old_path.handshake(deadline())
        assert alice.data_slot.install(old_path)  # closes the node's own data path
        assert alice.data is old_path
        assert alice.data.lookup(keys, deadline()) is None  # not named in WELCOME: never sent
        assert alice.lookup(keys, deadline()) == Probe(2)  # answered over gRPC
        assert LOOKUP not in old.seen and HELLO in old.seen
        assert alice.data is not None  # nothing failed: the data path stays
    finally:
        alice.close()
        old.close()


def test_busy_pool_sends_the_lookup_over_grpc(server: ServerProc) -> None:
    """A lookup never waits for a connection that chunk transfers hold."""
    alice = node(server, ALICE, connections=1)
    try:
        assert alice.data is not None
        held = alice.data._checkout(deadline())  # the one connection, as a long GET holds it
        start = time.monotonic()
        assert alice.data.lookup(make_keys(2, seed=47), deadline()) is None
        assert alice.lookup(make_keys(2, seed=47), deadline()) == Probe(0)
        assert time.monotonic() - start < 2.0
        alice.data._checkin(held, True)
        assert alice.data.lookup(make_keys(2, seed=47), deadline()) == Probe(0)
    finally:
        alice.close()


def test_broken_data_path_falls_back_to_grpc(tmp_path: Path) -> None:
    s = start_server(tmp_path, "--disk-dir", "disk", "--disk-bytes", "16MiB")
    alice = node(s, "")
    try:
        keys = make_keys(3, seed=48)
        assert alice.put([Entry(k, make_chunk(k, 2000, i), i) for i, k in enumerate(keys[:2])],
                         deadline()) == [True, True]
        assert alice.lookup(keys, deadline()) == Probe(2)
        assert alice.data is not None
        assert s.stop() == 0
        # Back on the same gRPC port without a data port: every pooled connection is dead and a
        # new one is refused, so the data path fails while the node answers over gRPC.
        s = start_server(tmp_path, "--disk-dir", "disk", "--disk-bytes", "16MiB",
                         ports=("--port", str(s.ports["grpc"]), "--http-port", "-1", "--data-port", "-1"))
        alice.stats(deadline())  # the gRPC channel reconnected
        assert alice.lookup(keys, deadline()) == Probe(2)
        assert alice.data is None  # gRPC carries lookups (and bytes) until the next retry
    finally:
        alice.close()
        s.stop()

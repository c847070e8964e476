"""How a kvtier-server finds and asks its dashboard peers: the reply parser, the host:port
parser, the ``peers`` setting, the fetch against real sockets that refuse, stall or babble,
and a peer name that resolves to several nodes (a Kubernetes headless Service) against two
real servers."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.protocol.addresses import parse_hostport
from kvtier.server import dashboard
from kvtier.server.dashboard import cluster_document
from tests.kvtier_servers import start_server
from tests.redis_servers import free_port


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, dict(resp.headers), resp.read()


@pytest.mark.parametrize("raw, error", [
    (b"HTTP/1.1 500 Internal\r\n\r\noops", "HTTP 500"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]", "not a kvtier"),
    (b"HTTP/1.1 200 OK\r\n\r\n{\"tenants\": ", "line 1"),
    (b"SSH-2.0-OpenSSH\r\n", "truncated"),
    (b"garbage\r\n\r\n{}", "not an HTTP reply"),
])
def test_parse_http_reply_refuses_what_is_not_stats(raw: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        dashboard.parse_http_reply(raw)


def test_parse_hostport() -> None:
    """The one host:port parser (the dashboard's peers, kvtier top, the server's peers setting,
    dns discovery, kvtier demo --server)."""
    assert parse_hostport("10.0.0.1:50052") == ("10.0.0.1", 50052)
    assert parse_hostport("[::1]:7") == ("::1", 7)
    for bad in ("nohost", ":80", "h:", "h:x", "h:0", "h:65536"):
        with pytest.raises(ValueError, match="is not host:port"):
            parse_hostport(bad)


# --- the peer fetch against real sockets ----------------------------------------------------------

def test_fetch_refused_stalled_and_babbling_peers_are_down_within_the_timeout() -> None:
    stalled = socket.socket()  # accepts (kernel backlog) but never answers
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)
    babbler = socket.socket()
    babbler.bind(("127.0.0.1", 0))
    babbler.listen(8)

    def babble() -> None:
        conn, _ = babbler.accept()
        with conn:
            conn.recv(1024)
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nthis is not json")

    t = threading.Thread(target=babble, daemon=True)
    t.start()
    peers = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{stalled.getsockname()[1]}",
             f"127.0.0.1:{babbler.getsockname()[1]}"]
    try:
        start = time.monotonic()
        replies = asyncio.run(dashboard.gather(peers, timeout=0.3))
        elapsed = time.monotonic() - start
    finally:
        stalled.close()
        babbler.close()
    assert [r.doc for r in replies] == [None, None, None]
    assert replies[0].error and "0.3s" in replies[1].error and replies[2].error.startswith("bad reply")
    assert elapsed < 2.0  # concurrent: one timeout, not three; generous for a loaded CI box


def test_peers_setting_is_validated() -> None:
    from kvtier.errors import ConfigError
    from kvtier.server.config import load_server_config

    cfg = load_server_config(env={"KVTIER_SERVER_PEERS": "10.0.0.2:50052, [::1]:50052"})
    assert cfg.peers == ("10.0.0.2:50052", "[::1]:50052")
    with pytest.raises(ConfigError, match="peers"):
        load_server_config(overrides={"peers": "10.0.0.2"}, env={})


def test_a_peer_name_with_several_addresses_is_every_node_behind_it(tmp_path: Path) -> None:
    """``peers: kvtier-metrics:50052`` (a Kubernetes headless Service: one A record per
    kvtier-server pod) shows every pod, and one that stops answering shows down. Two real
    servers on 127.0.0.1 and 127.0.0.2, same HTTP port; the name's records are given by a
    resolver function (no DNS server here), the servers and their replies are real."""
    port = free_port()
    a = start_server(tmp_path / "a", "--node-id", "node-a", ports=("--port", "0", "--http-port", str(port),
                                                                  "--data-port", "-1"), name="a")
    try:
        b = start_server(tmp_path / "b", "--node-id", "node-b", "--host", "127.0.0.2",
                         ports=("--port", "0", "--http-port", str(port), "--data-port", "-1"), name="b")
    except BaseException:
        a.kill()
        raise

    async def headless(host: str, _port: int) -> list[str]:
        assert host == "kvtier-metrics.test"
        return ["127.0.0.2", "127.0.0.1", "::1", "127.0.0.1"]  # dual stack, one record twice

    try:
        peers = [f"kvtier-metrics.test:{port}"]
        replies = asyncio.run(dashboard.gather(peers, 2.0, resolve=headless))
        assert [r.address for r in replies] == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
        local = json.loads(get(a.http + "/api/stats")[2])
        doc = cluster_document(local, replies)
        assert [(n["node_id"], n["up"]) for n in doc["nodes"]] == [("node-a", True), ("node-b", True)]
        b.kill()
        doc = cluster_document(local, asyncio.run(dashboard.gather(peers, 2.0, resolve=headless)))
        assert [(n["node_id"], n["up"]) for n in doc["nodes"]] == [("node-a", True), (f"127.0.0.2:{port}", False)]
        # A name with one address (IPv4 and IPv6 of one host) stays one peer: a node listening
        # on one family must not show down on the other.
        assert asyncio.run(dashboard.addresses(f"localhost:{port}")) == [f"localhost:{port}"]
    finally:
        for s in (a, b):
            s.kill()

"""The redis tier's reading of replies it did not expect (kvtier/tiers/redis/tier.py: ``get``).

A real redis-server answers GETRANGE with a bulk string, always (tests/test_redis_tier.py runs
the tier against real ones). What sits at a configured Redis address need not be Redis: a
proxy, a look-alike, a service that speaks RESP badly. This module's peer is such a server on a
free loopback port (it stands in for no kvtier component: real Redis cannot send these
replies): it answers the client's handshake as an old Redis does and every GETRANGE with the
reply under test (an integer, an array, a map, a double, an error, garbage, ...). The tier
rule holds whatever comes: no verb raises, a read is a chunk's bytes or a Miss, and a reply
that is not a string is never handed on as one (it once raised TypeError out of ``get``, or
returned a list where a chunk belongs).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.config import RedisTierConfig
from kvtier.tiers.base import Miss
from kvtier.tiers.redis import RedisTier
from tests.contract import key_of

KEYS = [key_of(f"resp-{i}") for i in range(3)]


class OddPeer:
    """A RESP server: +PONG to PING, an error to HELLO (an old Redis: the client falls back to
    RESP2), +OK to anything else, and ``reply`` to each GETRANGE."""

    def __init__(self) -> None:
        self.reply = b"$0\r\n\r\n"
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while data := conn.recv(65536):
                buf += data
                while (command := _command(buf)) is not None:
                    name, buf = command
                    conn.sendall(b"+PONG\r\n" if name == b"PING" else b"-ERR unknown command\r\n"
                                 if name == b"HELLO" else self.reply if name == b"GETRANGE" else b"+OK\r\n")
        except OSError:
            pass  # the client hung up (it drops a connection after a reply it cannot parse)

    def close(self) -> None:
        self.listener.close()
        for conn in self._conns:
            conn.close()
        self._thread.join(5)


def _command(buf: bytes) -> tuple[bytes, bytes] | None:
    """(upper-cased command name, the rest) of the first whole RESP array in ``buf``."""
    if not buf.startswith(b"*") or b"\r\n" not in buf:
        return None
    head, rest = buf[1:].split(b"\r\n", 1)
    parts = []
    for _ in range(int(head)):
        if b"\r\n" not in rest:
            return None
        size, rest = rest[1:].split(b"\r\n", 1)
        if len(rest) < int(size) + 2:
            return None
        parts.append(rest[: int(size)])
        rest = rest[int(size) + 2 :]
    return parts[0].upper(), rest


@pytest.fixture(scope="module")
def peer() -> Iterator[OddPeer]:
    p = OddPeer()
    yield p
    p.close()


def _served(peer: OddPeer, reply: bytes) -> tuple[list[bytes | Miss], list[int | Miss]]:
    """get and get_into of KEYS through a fresh tier (a parse error backs the node off)."""
    peer.reply = reply
    tier = RedisTier(RedisTierConfig(url=f"redis://127.0.0.1:{peer.port}", timeout_s=0.5))
    try:
        got = tier.get(KEYS)
        into = tier.get_into(KEYS, [memoryview(bytearray(64)) for _ in KEYS])
        tier.probe(KEYS)
        return got, into
    finally:
        tier.close()


ODD = {"integer": b":5\r\n", "array": b"*1\r\n$3\r\nabc\r\n", "nested": b"*2\r\n:1\r\n*1\r\n+x\r\n",
       "double": b",1.5\r\n", "map": b"%1\r\n+a\r\n+b\r\n", "simple": b"+OK\r\n", "boolean": b"#t\r\n"}


@pytest.mark.parametrize("reply", list(ODD.values()), ids=list(ODD))
def test_a_reply_that_is_not_a_string_is_a_miss(peer: OddPeer, reply: bytes) -> None:
    got, into = _served(peer, reply)
    if reply.startswith(b"+"):  # a simple string is a string: bytes, handed on for the store to verify
        assert got == [b"OK"] * len(KEYS)
        return
    assert all(isinstance(v, Miss) for v in got + into), (got, into)  # type: ignore[operator]


resp = st.recursive(
    st.one_of(st.integers(-(1 << 63), (1 << 63) - 1).map(lambda n: b":%d\r\n" % n),
              st.binary(max_size=40).map(lambda b: b"$%d\r\n%s\r\n" % (len(b), b)),
              st.sampled_from([b"$-1\r\n", b"*-1\r\n", b"_\r\n", b"-ERR odd\r\n", b"-WRONGTYPE x\r\n", b",inf\r\n",
                               b"(12345678901234567890\r\n", b"#f\r\n", b"!3\r\nerr\r\n", b"=7\r\ntxt:abc\r\n",
                               b"?\r\n", b"\r\n", b"$5\r\nab\r\n", b"*3\r\n"])),
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: b"*%d\r\n" % len(xs) + b"".join(xs)),
    max_leaves=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reply=resp)
def test_any_reply_leaves_the_verbs_standing(peer: OddPeer, reply: bytes) -> None:
    """Arbitrary RESP values and fragments (some cut short: the read times out): only bytes or
    Miss come back, bytes only from a string reply."""
    got, into = _served(peer, reply)
    for value in got:
        assert isinstance(value, (bytes, Miss)), value
    for n in into:
        assert isinstance(n, (int, Miss)), n

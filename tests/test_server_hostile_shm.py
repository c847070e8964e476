"""kvtier-server against a tenant with a valid token that breaks the shared-memory rules:
it resizes its segment, writes a corrupt chunk there, points past it, asks for a segment twice,
hands a stranger's ticket, never fetches the descriptor. Each case is one of issue 10's
reproductions; the server must stay up, serve other clients, and give away nothing it should not.

Real kvtier-server processes on loopback; the attacker speaks the wire protocol by hand
(tests/hostile_client.py).
"""

from __future__ import annotations

import errno
import mmap
import os
import socket
import time
from pathlib import Path

import pytest

from kvtier.protocol.frames import (
    ERROR,
    PUT_REPLY,
    encode_get,
    encode_put,
    encode_put_ref,
    encode_shm_mapped,
)
from kvtier.protocol.socket_io import read_frame, send_all
from tests.hostile_client import (  # noqa: F401 (hostile_server: the "server" fixture)
    BOB,
    alive_and_serving,
    assert_shm_get,
    connect,
    fetch_fd,
    hostile_server,
    offer_segment,
    shm_names,
)
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server


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

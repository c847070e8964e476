"""Differential fuzz of the server's PUT runs over shared memory: kvtier/_putloop.c taking PUT
frames whose chunk is a reference into the connection's segment (kvtier.server.put_run),
against the data plane's Python frame loop (the reference).

Each example maps a real segment (the server's SHM_OPEN offer, its descriptor fetched as a
client does), writes chunks into it and sends a PUT batch of references mixed with inline
items and with what the server must refuse or hand to the frame reader: a corrupt chunk in
the segment, a reference past the segment's end (or wrapping around 2**64), an empty one, one
larger than a slot, a body of the wrong size, a reference with its parent key. The stream is
sent whole or cut off at a random byte. A real DataPlane answers it twice, with the C loop
and without; what it sends back after the handshake and what the store holds afterwards
(keys, chunk bytes, the tier's own ``check()``) must be the same."""

from __future__ import annotations

import mmap
import os
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol.frames import (
    ERROR,
    MORE,
    PUT,
    SHM,
    SHM_READY,
    WELCOME,
    FrameReader,
    encode_hello,
    encode_put,
    encode_put_ref,
    encode_shm_mapped,
    encode_shm_open,
    parse_shm_ready,
)
from kvtier.protocol.socket_io import read_frame, send_all
from kvtier.protocol.wire import encode_header
from kvtier.server import put_run
from kvtier.server import shm as shm_segment
from tests.hostile_client import LIMITS, fetch_fd
from tests.kvtier_servers import make_chunk, make_keys
from tests.put_run_plane import SLOT, plane, send_to_end

SEGMENT = 4 << 20
STRIDE = 128 << 10  # item i's chunk lies at i * STRIDE in the segment
KINDS = ("ref", "ref", "ref", "ref_parent", "inline", "ref_corrupt", "ref_past_end", "ref_wraps", "ref_empty",
         "ref_too_big", "ref_bad_body")


def _item(kind: str, i: int, key: bytes, more: bool, seg: mmap.mmap) -> bytes:
    """Item i of a batch as bytes on the wire; its chunk, where it has one, written into the
    segment at i * STRIDE."""
    chunk = make_chunk(key, (SLOT + 1000) if kind == "ref_too_big" else 4096 + 97 * i, seed=i)
    if kind == "inline":
        return b"".join(bytes(p) for p in encode_put(key, chunk, depth=i, more=more))
    if kind == "ref_corrupt":
        chunk = chunk[:-1] + bytes([chunk[-1] ^ 1])
    offset, length = i * STRIDE, len(chunk)
    seg[offset : offset + length] = chunk
    if kind == "ref_past_end":
        offset = SEGMENT - length + 1
    elif kind == "ref_wraps":
        offset = (1 << 64) - 16
    elif kind == "ref_empty":
        length = 0
    elif kind == "ref_bad_body":
        return encode_header(PUT, SHM | (MORE if more else 0), i, 40) + key + bytes(8)
    parent = b"\x07" * 32 if kind == "ref_parent" else b""
    return b"".join(bytes(p) for p in encode_put_ref(key, offset, length, i, parent, more))


def _converse(kinds: list[str], cut: int | None, with_loop: bool) -> tuple[bytes | None, dict[bytes, bytes], list[str]]:
    """What a fresh server answers to the batch (after the handshake; None: the connection was
    reset) and holds afterwards."""
    with plane(with_loop, shm_bytes=SEGMENT) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            reader = FrameReader(LIMITS)
            send_all(sock, encode_hello(""))
            assert read_frame(sock, reader).type == WELCOME
            send_all(sock, encode_shm_open())
            ready = read_frame(sock, reader)
            assert ready.type == SHM_READY, bytes(ready.body)
            offer = parse_shm_ready(ready)
            fd = fetch_fd(offer)
            assert fd is not None
            try:
                seg = mmap.mmap(fd, offer.size)
            finally:
                os.close(fd)
            send_all(sock, encode_shm_mapped(True))
            keys = make_keys(len(kinds), seed=len(kinds))
            stream = b"".join(_item(k, i, keys[i], i < len(kinds) - 1, seg) for i, k in enumerate(kinds))
            answer = send_to_end(sock, stream if cut is None else stream[: cut % (len(stream) + 1)])
            seg.close()
        return (answer, *server.held())


needs_both = pytest.mark.skipif(not (put_run.available() and shm_segment.AVAILABLE),
                                reason="kvtier._putloop not built, or no memfd shared segments here")


@needs_both
@settings(max_examples=120, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=20), cut=st.integers(0, 1 << 30),
       cut_it=st.booleans())
def test_c_shm_put_runs_answer_and_store_as_the_python_loop(kinds: list[str], cut: int, cut_it: bool) -> None:
    with_c = _converse(kinds, cut if cut_it else None, with_loop=True)
    without = _converse(kinds, cut if cut_it else None, with_loop=False)
    assert with_c[1:] == without[1:]
    if with_c[0] is not None and without[0] is not None:
        assert with_c[0] == without[0]
    assert with_c[2] == []  # the tier's invariants hold: no slot lost to a reservation


@needs_both
def test_a_clean_shm_batch_is_stored_whole_through_the_c_loop() -> None:
    """A control: the differential test above would pass if both paths refused everything."""
    kinds = ["ref"] * 10 + ["ref_parent"] * 3 + ["inline"] * 3
    loop, taken = put_run._PUTLOOP, []

    class Recording:  # the C loop, noting the flags of each item it took
        def __getattr__(self, name: str) -> object:
            return getattr(loop, name)

        def recv_puts(self, *args: object) -> tuple[list[tuple[int, int, int, int]], int]:
            items, have = loop.recv_puts(*args)
            taken.extend(flags for flags, _, _, _ in items)
            return items, have

    put_run._PUTLOOP = Recording()
    try:
        answer, held, problems = _converse(kinds, None, with_loop=True)
    finally:
        put_run._PUTLOOP = loop
    assert sum(1 for f in taken if f & SHM) == 13 and len(taken) == 16  # every item through the C loop
    keys = make_keys(len(kinds), seed=len(kinds))
    assert problems == [] and set(held) == set(keys) and answer is not None
    assert all(held[k] == make_chunk(k, 4096 + 97 * i, seed=i) for i, k in enumerate(keys))
    assert answer.endswith(b"\x01" * len(kinds))  # PUT_REPLY: every item stored


@needs_both
@pytest.mark.parametrize("bad", ["ref_past_end", "ref_wraps", "ref_corrupt"])
def test_a_bad_reference_leaves_nothing_of_its_batch(bad: str) -> None:
    """A reference outside the segment ends the connection (a protocol error), a corrupt chunk
    refuses the batch: either way the answer names what is wrong and none of the batch's items
    is kept, the good ones before it included, though the C loop had already copied them into
    slots."""
    answer, held, problems = _converse(["ref", "ref", bad], None, with_loop=True)  # last: a hang-up with
    # bytes unread would reset the connection before the ERROR frame is read
    assert held == {} and problems == []
    assert answer is not None and answer[2] == ERROR  # one ERROR frame, no PUT_REPLY
    want = b"payload checksum mismatch" if bad == "ref_corrupt" else b"outside any mapped segment"
    assert want in answer, answer

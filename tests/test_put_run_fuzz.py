"""Differential fuzz of the server's PUT runs: kvtier/_putloop.c (kvtier.server.put_run)
receiving a batch's frames, against the data plane's Python frame loop (the reference).

Each example is a PUT batch of valid items (one may hold an empty tensor: a header and no
payload) mixed with items the server must refuse or hand to the frame reader (a corrupt
payload, another key in the chunk header, a chunk larger than a slot, less than a chunk
header, no chunk at all, a shared-memory reference, a GET inside the batch, a bad magic),
sent whole or cut off at a random byte. A real DataPlane on a loopback socket answers it
twice, once with the C loop and once without; the bytes it sends back and what the store
holds afterwards (keys, chunk bytes, the tier's own ``check()``) must be the same."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.protocol.frames import GET, MORE, PARENT, PUT, SHM, encode_hello, encode_put
from kvtier.protocol.wire import encode_header
from kvtier.server import put_run
from tests.kvtier_servers import make_chunk, make_keys
from tests.put_run_plane import SLOT, plane, send_to_end

KINDS = ("ok", "ok", "ok", "parent", "corrupt", "other_key", "too_big", "empty", "no_payload", "short", "shm",
         "get", "magic")


def _frame(kind: str, i: int, key: bytes, more: bool) -> bytes:
    """One item of a batch (``more``: another follows), as bytes on the wire."""
    chunk = make_chunk(key, 4096 + 97 * i, seed=i)
    if kind == "parent":
        return b"".join(bytes(p) for p in encode_put(key, chunk, depth=i, parent=b"\x07" * 32, more=more))
    if kind == "corrupt":
        chunk = chunk[:-1] + bytes([chunk[-1] ^ 1])
    elif kind == "other_key":
        chunk = make_chunk(b"\x09" * 32, 4096, seed=i)
    elif kind == "no_payload":  # a valid chunk of an empty tensor: its header only
        chunk = make_chunk(key, 0, seed=i)
    elif kind == "short":  # not even a chunk header
        chunk = chunk[:100]
    elif kind == "too_big":
        chunk = make_chunk(key, SLOT + 1000, seed=i)
    elif kind == "empty":
        return encode_header(PUT, MORE if more else 0, 0, 32) + key
    elif kind == "shm":
        return encode_header(PUT, SHM | (MORE if more else 0), 0, 48) + key + bytes(16)
    elif kind == "get":
        return encode_header(GET, 0, 1, 32) + key
    elif kind == "magic":
        return b"XW" + encode_header(PUT, 0, 0, 0)[2:]
    return b"".join(bytes(p) for p in encode_put(key, chunk, depth=i, more=more))


def _converse(stream: bytes, with_loop: bool, max_batch_keys: int = 64) -> tuple[bytes | None, dict[bytes, bytes], list[str]]:
    """What a fresh server answers to ``stream`` (None: the connection was reset) and holds
    afterwards."""
    with plane(with_loop, max_batch_keys=max_batch_keys) as server:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            answer = send_to_end(sock, b"".join(bytes(p) for p in encode_hello("")) + stream)
        return (answer, *server.held())


@pytest.mark.skipif(not put_run.available(), reason="kvtier._putloop not built here (optional accelerator)")
@settings(max_examples=200, deadline=None)
@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=20), cut=st.integers(0, 1 << 30),
       cut_it=st.booleans(), max_batch_keys=st.sampled_from([64, 8]))
def test_c_put_runs_answer_and_store_as_the_python_loop(kinds: list[str], cut: int, cut_it: bool,
                                                        max_batch_keys: int) -> None:
    """(``max_batch_keys`` 8: batches of up to 20 items run past the server's limit.)"""
    keys = make_keys(len(kinds), seed=len(kinds))
    stream = b"".join(_frame(k, i, keys[i], i < len(kinds) - 1) for i, k in enumerate(kinds))
    if cut_it:
        stream = stream[: cut % (len(stream) + 1)]
    with_c = _converse(stream, with_loop=True, max_batch_keys=max_batch_keys)
    without = _converse(stream, with_loop=False, max_batch_keys=max_batch_keys)
    assert with_c[1:] == without[1:]
    if with_c[0] is not None and without[0] is not None:
        assert with_c[0] == without[0]
    assert with_c[2] == []  # the tier's invariants hold: no slot lost to a reservation


def test_the_c_loop_is_built_where_ci_runs() -> None:
    if not put_run.available():
        assert not os.environ.get("CI"), "kvtier._putloop was not built: pip install -e . with a C compiler"
        pytest.skip("kvtier._putloop not built here (optional accelerator)")
    from kvtier import _putloop

    assert (_putloop.MORE, _putloop.PARENT) == (MORE, PARENT)


def test_a_clean_batch_is_stored_whole_through_the_c_loop() -> None:
    """A control: the differential test above would pass if both paths refused everything."""
    kinds = ["ok"] * 12 + ["parent"] * 4
    keys = make_keys(len(kinds), seed=99)
    stream = b"".join(_frame(k, i, keys[i], i < len(kinds) - 1) for i, k in enumerate(kinds))
    answer, held, problems = _converse(stream, with_loop=put_run.available())
    assert problems == [] and set(held) == set(keys) and answer is not None
    assert all(held[k] == make_chunk(k, 4096 + 97 * i, seed=i) for i, k in enumerate(keys))
    assert answer.endswith(b"\x01" * len(kinds))  # PUT_REPLY: every item stored


@pytest.mark.parametrize("with_loop", [True, False], ids=["c_loop", "python_loop"])
def test_a_batch_past_max_batch_keys_is_refused_and_keeps_no_slot(with_loop: bool) -> None:
    """The item past the limit had been received into a reserved slot when the session
    refused it; that slot once stayed "writing" for good (capacity lost per such batch)."""
    if with_loop and not put_run.available():
        pytest.skip("kvtier._putloop not built here (optional accelerator)")
    keys = make_keys(10, seed=7)
    stream = b"".join(_frame("ok", i, k, i < len(keys) - 1) for i, k in enumerate(keys))
    for _ in range(3):
        answer, held, problems = _converse(stream, with_loop=with_loop, max_batch_keys=8)
        assert answer is None or b"max_batch_keys=8" in answer
        assert held == {} and problems == []


def test_a_plane_leaves_no_thread_behind() -> None:
    """The harness itself: each example starts a server and a store, and thousands of examples
    run in one process (a long fuzz campaign once held 4,000 warm-ahead threads and 6 GiB)."""
    before = set(threading.enumerate())
    for _ in range(3):
        _converse(b"", with_loop=put_run.available())
    assert [t.name for t in set(threading.enumerate()) - before] == []


@pytest.mark.skipif(not put_run.available(), reason="kvtier._putloop not built here (optional accelerator)")
@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, (128 << 10) - 1, 128 << 10, (128 << 10) + 1, (4 << 20) + 4096 + 17])
def test_copy_hash_stores_the_chunk_and_hashes_what_it_stored(n: int) -> None:
    """The shared-memory PUT's copy into a slot (through the bounce buffer, streaming stores):
    every byte arrives, and the digest is xxh3 of the copy from ``hash_from`` on (0 when the
    chunk is shorter), for sizes around the bounce buffer's and starts inside and past it."""
    import xxhash

    src = os.urandom(n)
    for hash_from in (0, 64, 200_000):
        dst = bytearray(n)
        got = put_run._PUTLOOP.copy_hash(dst, src, hash_from, put_run.PIECE)
        assert dst == src
        assert got == (xxhash.xxh3_64_intdigest(src[hash_from:]) if n >= hash_from else 0)

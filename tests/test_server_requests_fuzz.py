"""The server's request decoding, in process: the exact functions the servicer calls on a
request's raw bytes before anything is stored (tests/test_server_badinput.py sends the same
kinds of bytes to a real server). A hypothesis fuzz of every decoder, and the check that a
flood of items is refused before protobuf parses it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.server.requests import (
    BadRequest,
    Limits,
    decode_info,
    decode_keys,
    decode_put,
    decode_stats,
)
from tests.kvtier_servers import make_chunk, make_keys

MAX_MESSAGE = 2 << 20
MAX_CHUNK = 1 << 20
MAX_KEYS = 64
Code = grpc.StatusCode
LIMITS = Limits(max_batch_keys=MAX_KEYS, max_chunk_bytes=MAX_CHUNK, max_message_bytes=MAX_MESSAGE)
DECODERS: dict[str, Callable[[bytes], Any]] = {
    "Lookup": lambda raw: decode_keys(raw, "Lookup", LIMITS),
    "Get": lambda raw: decode_keys(raw, "Get", LIMITS),
    "Delete": lambda raw: decode_keys(raw, "Delete", LIMITS),
    "Put": lambda raw: decode_put(raw, LIMITS),
    "Stats": decode_stats,
    "Info": decode_info,
}


def test_the_item_count_is_checked_before_the_parser_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood is refused without calling protobuf's parser at all (the server test in
    tests/test_server_badinput.py would pass, only slower, if it were parsed first)."""
    from kvtier.server import requests

    def no_parse(*args: object) -> None:
        raise AssertionError("parsed before the count was checked")

    monkeypatch.setattr(requests, "_parse", no_parse)
    flood = b"\x0a\x00" * (MAX_KEYS * 17 + 1)  # more bytes than MAX_KEYS keys of 34 bytes take
    for decode in (DECODERS["Put"], DECODERS["Lookup"], DECODERS["Get"], DECODERS["Delete"]):
        with pytest.raises(BadRequest, match="max_batch_keys") as info:
            decode(flood)
        assert info.value.code == Code.RESOURCE_EXHAUSTED
    # Fields of every wire type count, and one more than the limit is enough to refuse.
    mixed = (b"\x08\x01" + b"\x11" + bytes(8) + b"\x1d" + bytes(4) + b"\x0a\x00") * ((MAX_KEYS + 4) // 4)
    with pytest.raises(BadRequest, match="max_batch_keys"):
        DECODERS["Put"](mixed[: (MAX_KEYS + 1) // 4 * 17 + 17])


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(sorted(DECODERS)), raw=st.binary(max_size=600))
def test_fuzz_raw_request_bytes(method: str, raw: bytes) -> None:
    try:
        result = DECODERS[method](raw)
    except BadRequest as exc:
        assert exc.code in (Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.DATA_LOSS) and exc.message
        return
    if method in ("Lookup", "Get", "Delete"):
        assert all(len(k) == 32 for k in result) and len(result) <= MAX_KEYS


_VALID_KEY = make_keys(1, seed=45)[0]
_VALID_CHUNK = make_chunk(_VALID_KEY, 256)


@st.composite
def put_items(draw: st.DrawFn) -> pb.PutItem:
    key = draw(st.one_of(st.just(_VALID_KEY), st.binary(min_size=0, max_size=40)))
    chunk = bytearray(_VALID_CHUNK)
    for _ in range(draw(st.integers(0, 3))):  # a few mutations of a valid chunk
        if chunk:
            chunk[draw(st.integers(0, len(chunk) - 1))] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(chunk)))
    data = bytes(chunk[:cut]) if draw(st.booleans()) else bytes(chunk)
    parent = draw(st.one_of(st.just(b""), st.binary(min_size=0, max_size=40)))
    return pb.PutItem(key=key, chunk=data, depth=draw(st.integers(0, 2**32 - 1)), parent=parent)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(put_items(), max_size=5))
def test_fuzz_put_requests(items: list[pb.PutItem]) -> None:
    raw = pb.PutRequest(items=items).SerializeToString()
    try:
        entries = decode_put(raw, LIMITS)
    except BadRequest as exc:
        assert exc.code in (Code.INVALID_ARGUMENT, Code.DATA_LOSS, Code.RESOURCE_EXHAUSTED) and exc.message
        return
    # Accepted means: exactly the valid chunk under its own key (mutations of a checksummed
    # chunk cannot survive verification except by a 2^-64 chance).
    assert all(e.key == _VALID_KEY and bytes(e.data) == _VALID_CHUNK for e in entries)

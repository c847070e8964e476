"""Fuzz of the chunk decoder past its checksums: what reaches the codecs (kvtier/codec.py).

tests/test_chunk.py flips bytes of valid chunks, but a flipped payload byte fails the payload
checksum before any decompressor sees it. Here every forged chunk is resealed (its payload
checksum and its header checksum recomputed, as a hostile node or a planted file can), so the
lz4 and zstd decoders get arbitrary and mutated streams under a header that is otherwise sound.
What must hold: the only error is a ChunkError, a chunk that decodes has exactly the header's
length, and no stream makes the decoder allocate much more than that length, whatever sizes
the stream itself claims (tracemalloc sees the codecs' output buffers: they are Python bytes).
"""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable

import lz4.block
import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.chunk import DTYPES, HEADER_SIZE, decode_chunk, encode_chunk
from kvtier.codec import Codec, decompress
from kvtier.errors import ChunkError

NS, KEY = b"n" * 32, b"k" * 32
SHAPE = (2, 2, 16, 2, 8)
RAW_LEN = math.prod(SHAPE) * 2  # float16
PAYLOAD = np.random.default_rng(5).standard_normal(math.prod(SHAPE)).astype(np.float16).tobytes()
# What one decode may allocate beyond the chunk's own length: the shuffled copy, the bytes
# objects, hypothesis' and tracemalloc's own bookkeeping. Far below any bomb's claim.
SLACK = 4 * RAW_LEN + (256 << 10)


def _seal(data: bytearray) -> bytearray:
    """Recompute the payload checksum (over the stored length the header names) and the header
    checksum: the forgery is then refused, if at all, for what it says, not for its seals."""
    stored = int.from_bytes(data[104:112], "little")
    data[112:120] = xxhash.xxh3_64_intdigest(bytes(data[HEADER_SIZE : HEADER_SIZE + stored])).to_bytes(8, "little")
    data[120:128] = xxhash.xxh3_64_intdigest(bytes(data[:120])).to_bytes(8, "little")
    return data


def _forge(codec: int, stored: bytes, shuffled: bool = False) -> bytearray:
    """A chunk of KEY and SHAPE whose stored payload is ``stored`` under ``codec``, sealed."""
    data = bytearray(encode_chunk(NS, KEY, "float16", SHAPE, PAYLOAD)[:HEADER_SIZE]) + stored
    data[6], data[7] = codec, 1 if shuffled else 0
    data[104:112] = len(stored).to_bytes(8, "little")
    return _seal(data)


def _peak(fn: Callable[[], object]) -> tuple[object, int]:
    """(what ``fn`` returned or raised, the peak of Python allocations while it ran)."""
    tracemalloc.start()
    try:
        try:
            out: object = fn()
        except Exception as exc:  # noqa: BLE001 - the outcome under test is the exception itself
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _decode(data: bytes | bytearray) -> Callable[[], object]:
    return lambda: decode_chunk(data, namespace=NS, key=KEY, dtype="float16", shape=SHAPE)


def _check(out: object, peak: int) -> None:
    if isinstance(out, Exception):
        assert isinstance(out, ChunkError), repr(out)
        assert out.reason == "corrupt", out
    else:
        assert len(out.payload) == RAW_LEN  # type: ignore[attr-defined]
    assert peak < SLACK, f"decoding a {RAW_LEN}-byte chunk allocated {peak} bytes"


def test_a_zstd_frame_declaring_more_than_the_header_is_refused_before_decompressing() -> None:
    """A 2 KiB zstd frame that declares (and holds) 64 MiB, under a header of 2 KiB: zstd's
    max_output_size bounds only frames that do not declare a size, so this one was inflated
    whole into a 64 MiB buffer before the length check refused it (a 32 MiB chunk limit lets
    such a frame claim terabytes)."""
    bomb = zstandard.ZstdCompressor(level=3).compress(bytes(64 << 20))
    assert len(bomb) < 8192 and zstandard.get_frame_parameters(bomb).content_size == 64 << 20
    out, peak = _peak(_decode(_forge(int(Codec.ZSTD), bomb)))
    assert isinstance(out, ChunkError) and out.reason == "corrupt", out
    assert "declares" in str(out)
    assert peak < SLACK, f"allocated {peak} bytes for a {RAW_LEN}-byte chunk"
    # The codec alone, as any other caller uses it: the same bound.
    out, peak = _peak(lambda: decompress(Codec.ZSTD, bomb, RAW_LEN))
    assert isinstance(out, ChunkError) and peak < SLACK, (out, peak)


def test_a_zstd_frame_without_a_declared_size_is_cut_at_the_header_length() -> None:
    bomb = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes(64 << 20))
    out, peak = _peak(_decode(_forge(int(Codec.ZSTD), bomb)))
    _check(out, peak)
    assert isinstance(out, ChunkError)


def test_an_lz4_block_that_expands_past_the_header_length_is_refused() -> None:
    bomb = lz4.block.compress(bytes(16 << 20), store_size=False)
    out, peak = _peak(_decode(_forge(int(Codec.LZ4), bomb)))
    _check(out, peak)
    assert isinstance(out, ChunkError)


def test_a_zstd_frame_declaring_less_than_the_header_is_refused() -> None:
    short = zstandard.ZstdCompressor().compress(PAYLOAD[:-2])
    out, _ = _peak(_decode(_forge(int(Codec.ZSTD), short)))
    assert isinstance(out, ChunkError) and out.reason == "corrupt"


def _valid_stored(codec: str, shuffled: bool) -> bytes:
    data = encode_chunk(NS, KEY, "float16", SHAPE, bytes(RAW_LEN // 2) + PAYLOAD[: RAW_LEN // 2], codec=codec,
                        shuffle=shuffled)
    assert data[6] == int(Codec.parse(codec))  # compressible: the codec was kept
    return bytes(data[HEADER_SIZE:])


@settings(max_examples=400, deadline=None)
@given(codec=st.sampled_from(["lz4", "zstd"]), shuffled=st.booleans(),
       edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255), st.sampled_from(["set", "cut", "ins"])),
                      min_size=1, max_size=4))
def test_mutated_compressed_payloads_resealed(codec: str, shuffled: bool, edits: list[tuple[int, int, str]]) -> None:
    """A valid lz4/zstd payload with bytes changed, cut off or inserted (the seals recomputed):
    a ChunkError, or a payload of exactly the header's length; allocation bounded by it."""
    stored = bytearray(_valid_stored(codec, shuffled))
    for pos, value, op in edits:
        at = pos % (len(stored) + 1)
        if op == "set" and at < len(stored):
            stored[at] = value
        elif op == "cut":
            del stored[at:]
        else:
            stored[at:at] = bytes([value]) * (1 + value % 8)
    out, peak = _peak(_decode(_forge(int(Codec.parse(codec)), bytes(stored), shuffled)))
    _check(out, peak)


@settings(max_examples=300, deadline=None)
@given(codec=st.sampled_from([int(Codec.LZ4), int(Codec.ZSTD)]), shuffled=st.booleans(),
       head=st.sampled_from([b"", b"\x28\xb5\x2f\xfd", b"\x50\x2a\x4d\x18", b"\xff"]), body=st.binary(max_size=300))
def test_arbitrary_compressed_payloads_resealed(codec: int, shuffled: bool, head: bytes, body: bytes) -> None:
    """Random streams (some behind a zstd frame or skippable-frame magic): the same rules."""
    out, peak = _peak(_decode(_forge(codec, head + body, shuffled)))
    _check(out, peak)


@settings(max_examples=300, deadline=None)
@given(dims=st.lists(st.integers(0, 0xFFFFFFFF), min_size=5, max_size=5), dtype=st.sampled_from(sorted(DTYPES)))
def test_shapes_whose_product_overflows_64_bits_are_refused(dims: list[int], dtype: str) -> None:
    """A header whose raw length is its shape's byte count modulo 2**64 (what a reader with
    64-bit arithmetic would compute) matches only when nothing wrapped."""
    layers, kv, tokens, heads, head_dim = dims
    data = bytearray(encode_chunk(NS, KEY, "float16", SHAPE, PAYLOAD)[:HEADER_SIZE])
    kv &= 0xFF  # a one-byte field
    data[8], data[9] = DTYPES[dtype][0], kv
    for i, d in enumerate((layers, tokens, heads, head_dim)):
        data[16 + 4 * i : 20 + 4 * i] = d.to_bytes(4, "little")
    true_len = layers * kv * tokens * heads * head_dim * DTYPES[dtype][1]
    data[96:104] = (true_len % (1 << 64)).to_bytes(8, "little")
    data[104:112] = bytes(8)
    _seal(data)
    try:
        chunk = decode_chunk(bytes(data))
    except ChunkError as exc:
        assert exc.reason in ("layout_mismatch", "corrupt"), exc
        assert true_len >= 1 << 64 or exc.reason == "corrupt"
        return
    assert true_len == 0 and len(chunk.payload) == 0


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.ZSTD])
def test_an_empty_payload_under_a_compressed_codec(codec: Codec) -> None:
    out, peak = _peak(_decode(_forge(int(codec), b"")))
    _check(out, peak)
    assert isinstance(out, ChunkError)

"""Chunk format and codecs: round trips, every refusal reason, and a fuzzed decoder."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.chunk import (
    HEADER_SIZE,
    decode_chunk,
    decode_header,
    encode_chunk,
    frame_raw_chunk,
    header_names,
    page_aligned_buffer,
    payload_checksum,
)
from kvtier.codec import Codec, compress, decompress, shuffle, unshuffle
from kvtier.errors import ChunkError

NS, KEY = b"n" * 32, b"k" * 32
SHAPE = (2, 2, 16, 2, 8)


def _payload(dtype: str = "float16", seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    n = int(np.prod(SHAPE))
    if dtype == "float32":
        return rng.standard_normal(n).astype(np.float32).tobytes()
    return rng.standard_normal(n).astype(np.float16).tobytes()


@pytest.mark.parametrize("codec", ["raw", "lz4", "zstd"])
@pytest.mark.parametrize("shuf", [False, True])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip(codec: str, shuf: bool, dtype: str) -> None:
    payload = _payload("float32" if dtype == "float32" else "float16")
    data = encode_chunk(NS, KEY, dtype, SHAPE, payload, codec=codec, shuffle=shuf)
    chunk = decode_chunk(data, namespace=NS, key=KEY, dtype=dtype, shape=SHAPE)
    assert bytes(chunk.payload) == payload
    if chunk.header.codec == Codec.RAW and codec != "raw":  # it did not shrink: stored raw
        assert len(data) == HEADER_SIZE + len(payload) and not chunk.header.shuffled
    else:
        assert chunk.header.codec == Codec.parse(codec) and chunk.header.shuffled == shuf


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
@pytest.mark.parametrize("shuf", [False, True])
def test_a_payload_the_codec_cannot_shrink_is_stored_raw(codec: str, shuf: bool) -> None:
    """Random bytes (as fp8 K/V nearly is) grow by ~n/255 under lz4: a chunk sized for raw
    pages (an SGLang page in a RAM slot) was refused on every put. Stored raw instead; a
    compressible payload keeps its codec."""
    noise = np.random.default_rng(3).integers(0, 256, int(np.prod(SHAPE)), dtype=np.uint8).tobytes()
    data = encode_chunk(NS, KEY, "uint8", SHAPE, noise, codec=codec, shuffle=shuf)
    chunk = decode_chunk(data, namespace=NS, key=KEY, dtype="uint8", shape=SHAPE)
    assert chunk.header.codec == Codec.RAW and not chunk.header.shuffled
    assert len(data) == HEADER_SIZE + len(noise) and bytes(chunk.payload) == noise
    zeros = bytes(len(noise))
    packed = encode_chunk(NS, KEY, "uint8", SHAPE, zeros, codec=codec, shuffle=shuf)
    assert decode_header(packed).codec == Codec.parse(codec) and len(packed) < HEADER_SIZE + len(zeros)


def test_shuffle_inverts() -> None:
    data = _payload()
    assert unshuffle(shuffle(data, 2), 2) == data
    assert decompress(Codec.LZ4, compress(Codec.LZ4, data, shuffle_itemsize=2), len(data),
                      shuffle_itemsize=2) == data


def _encoded() -> memoryview:
    return encode_chunk(NS, KEY, "float16", SHAPE, _payload())


@pytest.mark.parametrize("expect, reason", [
    (dict(namespace=b"x" * 32), "namespace_mismatch"),
    (dict(key=b"x" * 32), "key_mismatch"),
    (dict(dtype="bfloat16"), "layout_mismatch"),
    (dict(shape=(2, 2, 8, 2, 8)), "layout_mismatch"),
])
def test_foreign_chunks_are_refused(expect: dict, reason: str) -> None:
    with pytest.raises(ChunkError) as err:
        decode_chunk(_encoded(), **expect)
    assert err.value.reason == reason


def test_truncated_and_flipped_chunks_are_refused() -> None:
    data = _encoded()
    with pytest.raises(ChunkError) as err:
        decode_chunk(data[:-1])
    assert err.value.reason == "truncated"
    with pytest.raises(ChunkError) as err:
        decode_chunk(data[:50])
    assert err.value.reason == "truncated"
    for pos in (0, 5, 20, 70, 100, 119, 125, HEADER_SIZE + 3, len(data) - 1):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(ChunkError):
            decode_chunk(bad)


def test_padding_after_payload_is_ignored() -> None:
    data = bytes(_encoded()) + b"\0" * 4000
    assert bytes(decode_chunk(data).payload) == _payload()


def test_wrong_payload_size_is_refused_at_encode() -> None:
    with pytest.raises(ChunkError) as err:
        encode_chunk(NS, KEY, "float16", SHAPE, _payload()[:-2])
    assert err.value.reason == "layout_mismatch"
    with pytest.raises(ValueError, match="dtype"):
        encode_chunk(NS, KEY, "float64", SHAPE, _payload())


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_decoder_fuzz_random_bytes(data: bytes) -> None:
    try:
        decode_chunk(data)
    except ChunkError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2 * HEADER_SIZE), st.integers(1, 255)), min_size=1, max_size=4),
       st.sampled_from(["raw", "lz4", "zstd"]))
def test_decoder_fuzz_mutations(flips: list[tuple[int, int]], codec: str) -> None:
    good = encode_chunk(NS, KEY, "float16", SHAPE, _payload(), codec=codec, shuffle=True)
    bad = bytearray(good)
    for pos, mask in flips:
        bad[pos % len(bad)] ^= mask
    try:
        chunk = decode_chunk(bad)
    except ChunkError:
        return
    assert bytes(chunk.payload) == _payload()  # if it decodes at all, it decodes to the truth


def _names_oracle(data: bytes | bytearray, key: bytes) -> bool:
    """header_names' contract in terms of decode_header (the reference)."""
    try:
        h = decode_header(data)
    except ChunkError:
        return False
    return h.key == key and h.nbytes == len(data)


def _reseal(data: bytearray) -> None:
    """Recompute the header checksum, so that a mutated field reaches the field checks."""
    import xxhash

    data[HEADER_SIZE - 8 : HEADER_SIZE] = xxhash.xxh3_64_intdigest(bytes(data[: HEADER_SIZE - 8])).to_bytes(8, "little")


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.integers(0, HEADER_SIZE + 8), st.integers(1, 255)), max_size=3),
       st.booleans(), st.integers(-2, 2), st.sampled_from([KEY, b"j" * 32]))
def test_header_names_agrees_with_decode_header(flips: list[tuple[int, int]], reseal: bool, cut: int,
                                                key: bytes) -> None:
    """The fast guard takes exactly what decode_header takes (resealed mutations reach the
    magic, version, codec, dtype and layout checks), with the key and exact length."""
    data = bytearray(_encoded())
    for pos, mask in flips:
        data[pos % len(data)] ^= mask
    if reseal:
        _reseal(data)
    data = data[: len(data) + cut] if cut < 0 else data + bytes(cut)
    assert header_names(data, key) == _names_oracle(data, key)
    assert header_names(memoryview(data), key) == header_names(bytes(data), key)


def test_header_names_refuses_each_field() -> None:
    good = bytearray(_encoded())
    assert header_names(good, KEY) and not header_names(good, b"j" * 32)
    assert not header_names(good[:HEADER_SIZE - 1], KEY) and not header_names(good + b"\0", KEY)
    for pos in (0, 4, 6, 8, 16, 20, 28):  # magic, version, codec, dtype, layers, tokens, head_dim
        bad = bytearray(good)
        bad[pos] ^= 0x40
        _reseal(bad)
        assert not header_names(bad, KEY) and not _names_oracle(bad, KEY), pos
    assert header_names(np.frombuffer(bytes(good), dtype=np.uint8), KEY)
    assert payload_checksum(good) == decode_header(good).checksum


def test_header_alone_parses() -> None:
    h = decode_header(_encoded())
    assert h.shape == SHAPE and h.tokens == 16 and h.nbytes == HEADER_SIZE + h.payload_len


def test_encoded_chunks_are_page_aligned_and_writable() -> None:
    import numpy as np

    data = _encoded()
    assert np.frombuffer(data, np.uint8).ctypes.data % 4096 == 0 and not data.readonly


def test_frame_raw_chunk_in_place_equals_encode_chunk_and_refuses_a_short_buffer() -> None:
    ns, key, shape = b"n" * 32, b"k" * 32, (2, 2, 4, 3, 8)
    payload = np.random.default_rng(3).integers(0, 255, 2 * 2 * 4 * 3 * 8 * 2, dtype=np.uint8)
    buf = page_aligned_buffer(HEADER_SIZE + payload.size + 4096)
    buf[HEADER_SIZE:HEADER_SIZE + payload.size] = payload.tobytes()
    framed = frame_raw_chunk(buf, ns, key, "bfloat16", shape)
    assert bytes(framed) == bytes(encode_chunk(ns, key, "bfloat16", shape, payload.tobytes()))
    assert bytes(decode_chunk(framed, key=key, shape=shape).payload) == payload.tobytes()
    with pytest.raises(ValueError, match="cannot hold"):
        frame_raw_chunk(page_aligned_buffer(HEADER_SIZE + 8), ns, key, "bfloat16", shape)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        frame_raw_chunk(buf, ns, key, "float64", shape)

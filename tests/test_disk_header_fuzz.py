"""Fuzz of the disk tier's chunk-file reads (kvtier/tiers/disk: the header read of a probe, the
whole-file read and verify of get / get_into, the header scan of a restart).

tests/test_disk_tier.py plants one kind of bad file per test (truncated, a flipped bit, another
key's chunk, a file grown to 256 MiB). Here each example writes real chunks, then rewrites one
file at random: bytes changed, cut, extended, or header fields set to arbitrary values with the
header and payload checksums recomputed (so the mutation reaches the length, key and layout
checks, as a planted file would). Whatever the file holds, no verb raises, a read hands on only
bytes that are one whole chunk of the key asked for with a payload matching its checksum (never
a torn or foreign one), and the tier's own invariants (``check``) hold once a restart has rebuilt
the index from the headers.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.chunk import HEADER_SIZE, decode_header, page_aligned_buffer
from kvtier.config import DiskTierConfig
from kvtier.errors import ChunkError
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.disk import DiskTier
from tests.contract import chunk_for, key_of

KEYS = [key_of(f"fuzz-disk-{i}") for i in range(3)]
# Header fields a mutation may set (offset, size): codec, flags, dtype, kv, shape, key, raw and
# stored length.
FIELDS = [(6, 1), (7, 1), (8, 1), (9, 1), (16, 4), (20, 4), (24, 4), (28, 4), (64, 32), (96, 8), (104, 8)]


def _open(root: str, direct: bool) -> DiskTier:
    return DiskTier(DiskTierConfig(path=root, capacity_bytes=1 << 22, policy="lru", o_direct=direct))


def _reseal(data: bytearray) -> None:
    """Payload checksum over what the header says is stored (when the file holds it), then the
    header checksum: a forged file that passes both seals."""
    stored = int.from_bytes(data[104:112], "little")
    if HEADER_SIZE + stored <= len(data):
        data[112:120] = xxhash.xxh3_64_intdigest(bytes(data[HEADER_SIZE : HEADER_SIZE + stored])).to_bytes(8, "little")
    data[120:128] = xxhash.xxh3_64_intdigest(bytes(data[:120])).to_bytes(8, "little")


def _mutate(data: bytearray, edits: list[tuple[int, int, int]], reseal: bool) -> bytearray:
    for op, pos, value in edits:
        if op == 0 and data:  # any byte
            data[pos % len(data)] = value & 0xFF
        elif op == 1:  # a header field, set to a value of its width
            at, size = FIELDS[pos % len(FIELDS)]
            if at + size <= len(data):
                data[at : at + size] = (value * 0x9E3779B97F4A7C15 % (1 << 8 * size)).to_bytes(size, "little")
        elif op == 2:  # cut
            del data[pos % (len(data) + 1) :]
        elif op == 3:  # grow
            data += bytes([value & 0xFF]) * (1 + pos % 5000)
        elif op == 4 and len(data) >= 112:  # a stored length off by a little, or the file's own
            n = int.from_bytes(data[104:112], "little")
            n = (n + value % 7 - 3, len(data) - HEADER_SIZE, n + 4096)[pos % 3] % (1 << 64)
            data[104:112] = n.to_bytes(8, "little")
    if reseal and len(data) >= HEADER_SIZE:
        _reseal(data)
    return data


def _sound(key: bytes, value: bytes) -> bool:
    """Whether ``value`` is one whole chunk of ``key`` with a payload matching its checksum."""
    try:
        header = decode_header(value)
    except ChunkError:
        return False
    return (header.key == key and header.nbytes == len(value)
            and xxhash.xxh3_64_intdigest(value[HEADER_SIZE:]) == header.checksum)


def _served(tier: DiskTier, restarted: bool) -> None:
    """Every verb on every key: no exception, only sound chunks handed on; after a restart
    (the index rebuilt from the files as they are now) the tier's invariants hold too. (Before
    it, ``check`` rightly reports a file changed behind the index's back.)"""
    probe = tier.probe(KEYS)
    assert 0 <= probe.hits <= len(KEYS)
    for key, value in zip(KEYS, tier.get(KEYS)):
        assert isinstance(value, Miss) or _sound(key, value), value[:HEADER_SIZE]
    outs = [page_aligned_buffer(16384) for _ in KEYS]
    for key, out, got in zip(KEYS, outs, tier.get_into(KEYS, outs)):
        assert isinstance(got, Miss) or _sound(key, bytes(out[:got]))
    if restarted:
        assert tier.check(idle=True) == []


@settings(max_examples=40, deadline=None)
@given(which=st.integers(0, 2), direct=st.booleans(), reseal=st.booleans(),
       edits=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 1 << 16), st.integers(0, 1 << 20)),
                      min_size=1, max_size=4))
def test_a_rewritten_chunk_file_is_served_only_when_sound(which: int, direct: bool, reseal: bool,
                                                          edits: list[tuple[int, int, int]]) -> None:
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIER_TEST_TMP")) as root:
        tier = _open(root, direct)
        try:
            assert tier.put([Entry(k, chunk_for(k)) for k in KEYS]) == [True] * len(KEYS)
            path = Path(root) / KEYS[which].hex()[:2] / f"{KEYS[which].hex()}.kvc"
            path.write_bytes(_mutate(bytearray(path.read_bytes()), edits, reseal))
            _served(tier, restarted=False)
        finally:
            tier.close()
        again = _open(root, direct)  # a restart: the index rebuilt from the files' headers
        try:
            _served(again, restarted=True)
        finally:
            again.close()

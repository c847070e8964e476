"""Chunk parents (depth and parent key) survive the paths that used to drop them: a disk tier's
restart, a disk tier adopting a sharer's files, ``write_back`` handing an evicted chunk down,
and a promotion of a batch that starts past chunk 0. Prefix-aware policies evict leaves
before the prefixes they extend only when they know the links (kvtier/tiers/disk/lineage.py).

The invariant asserted at every eviction of a tier (``leaf_first``): the victim is not the
parent of a chunk that tier still holds. The restart test asserts more: the reopened tier
keeps exactly the keys a tier that never restarted keeps.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.config import DiskTierConfig, StoreConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry
from kvtier.tiers.disk import DiskTier, lineage
from kvtier.tiers.memory import MemoryTier
from tests.contract import LEAF_FIRST, chains, chunk_for, key_of

SIZE = len(chunk_for(key_of("size")))  # every chunk here has this many bytes (buffered I/O)


def open_tier(path: Path, chunks: int, policy: str) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=chunks * SIZE, policy=policy, o_direct=False))


def leaf_first(tier: DiskTier, parents: dict[bytes, bytes]) -> list[bytes]:
    """Watch ``tier``'s evictions: returns the list of victims that were the parent of a chunk
    the tier still held (the listener runs with the tier's lock held: its index is steady).
    A listener already there (a store's) is still called."""
    wrong: list[bytes] = []
    before = tier.evicted_key_listener

    def evicted(key: bytes) -> None:
        if any(parents.get(held) == key for held in tier._index):
            wrong.append(key)
        if before is not None:
            before(key)

    tier.evicted_key_listener = evicted
    return wrong


def parents_of(*groups: list[list[Entry]]) -> dict[bytes, bytes]:
    return {e.key: e.parent for group in groups for chain in group for e in chain}


def attr(path: Path) -> bytes | None:
    try:
        return os.getxattr(path, lineage.NAME)
    except OSError:
        return None


def file_of(tier: DiskTier, key: bytes) -> Path:
    return Path(tier._path(key))


# --- the three paths ---------------------------------------------------------------------------
@pytest.mark.parametrize("policy", LEAF_FIRST)
def test_a_restarted_tier_evicts_as_one_that_never_restarted(tmp_path: Path, policy: str) -> None:
    """Eight 4-chunk prefixes fill two tiers (one put per prefix, file times apart); one tier
    restarts. Two more prefixes then make both evict 6 chunks: both keep the same keys, and
    neither evicts a prefix chunk while a chunk extending it stays. (Before lineage records the
    restarted tier saw 32 roots: with ``prefix``, 3 of its 6 victims had a child it kept.)"""
    old, new = chains("a", 8, 4), chains("b", 2, 3)
    tiers = [open_tier(tmp_path / "kept", 32, policy), open_tier(tmp_path / "restarted", 32, policy)]
    for chain in old:
        for tier in tiers:
            assert tier.put(chain) == [True] * 4
        time.sleep(0.02)  # file times are coarse: the rebuild's oldest-first order is the put order
    tiers[1].close()
    tiers[1] = open_tier(tmp_path / "restarted", 32, policy)
    assert tiers[1].rebuild_stats.files == 32
    parents = parents_of(old, new)
    wrong = [leaf_first(tier, parents) for tier in tiers]
    for chain in new:
        for tier in tiers:
            assert tier.put(chain) == [True] * 3
    assert tiers[0].usage().evictions == 6
    assert wrong == [[], []]
    assert set(tiers[1]._index) == set(tiers[0]._index)
    for tier in tiers:
        assert tier.check(idle=True) == []
        tier.close()


@pytest.mark.parametrize("how", ["probe", "get"])
@pytest.mark.parametrize("policy", LEAF_FIRST)
def test_a_sharer_adopts_chunks_with_their_parents(tmp_path: Path, policy: str, how: str) -> None:
    """One process writes four prefixes; another finds them (a probe, or a read) and adopts
    them, then must evict: it evicts leaves, as the writer would. (Before, it adopted roots:
    all 3 of its victims had a child it kept.)"""
    written, mine = chains("w", 4, 4), chains("m", 1, 3)
    writer, reader = open_tier(tmp_path, 64, policy), open_tier(tmp_path, 16, policy)
    for chain in written:
        assert writer.put(chain) == [True] * 4
    for chain in written:
        keys = [e.key for e in chain]
        if how == "probe":
            assert reader.probe(keys).hits == 4
        else:
            assert reader.get(keys) == [e.data for e in chain]
    assert reader.usage().entries == 16
    wrong = leaf_first(reader, parents_of(written, mine))
    assert reader.put(mine[0]) == [True] * 3
    assert reader.usage().evictions == 3 and wrong == []
    assert reader.check() == [] and writer.check() == []
    writer.close()
    reader.close()


@pytest.mark.parametrize("policy", LEAF_FIRST)
def test_write_back_hands_each_chunk_down_with_its_parent(tmp_path: Path, policy: str) -> None:
    """RAM over disk, ``write_back``: requests for prefixes of 12 documents (skewed: some are
    hot), each loading what is cached and storing the rest. RAM evicts into disk, disk evicts
    for good: disk never evicts a chunk whose extension it still holds. (Before, every chunk
    written back reached disk as a root: with ``prefix``, 79 of 331 disk evictions broke that
    rule.)"""
    rng = random.Random(0)
    docs = chains("r", 12, 6)
    ram = MemoryTier(capacity_bytes=12 * SIZE, policy=policy, name="ram")
    disk = open_tier(tmp_path, 24, policy)
    store = TieredStore([ram, disk], StoreConfig(write_policy="write_back"))
    wrong = leaf_first(disk, parents_of(docs))
    for _ in range(300):
        doc = docs[min(int(rng.expovariate(0.3)), 11)]
        n = rng.randint(1, 6)
        keys = [e.key for e in doc[:n]]
        hit = store.lookup(keys, prefix=keys).hits
        store.load(keys[:hit], prefix=keys)
        store.store(doc[hit:n], prefix=keys)
        store.flush()
    assert disk.usage().evictions > 100 and wrong == []
    assert disk.check(idle=True) == [] and ram.check() == []
    store.close()


def test_a_promoted_batch_keeps_its_link_to_the_chunks_before(tmp_path: Path) -> None:
    """A loader reading a long prefix a batch at a time (``load(keys[lo:hi], prefix=keys)``):
    the chunks promoted into RAM carry their depth and parent from ``prefix``, so RAM's
    leaf-first policy keeps the chain whole (before, chunk ``lo`` was promoted as a root and
    chunk 1 was evicted first, cutting the prefix short)."""
    keys = [key_of(f"p/{d}") for d in range(6)]
    chain = [Entry(k, chunk_for(k), d, keys[d - 1] if d else b"") for d, k in enumerate(keys)]
    ram = MemoryTier(capacity_bytes=6 * SIZE, policy="prefix", name="ram")
    disk = open_tier(tmp_path, 24, "prefix")
    store = TieredStore([ram, disk])
    assert disk.put(chain) == [True] * 6
    for lo in (0, 2, 4):
        assert store.load(keys[lo:lo + 2], prefix=keys).sources == ["disk", "disk"]
    other = key_of("other")
    assert store.store([Entry(other, chunk_for(other))]) == 1  # RAM evicts one chunk
    assert [k in ram._data for k in keys] == [True] * 5 + [False]
    store.close()


# --- the records --------------------------------------------------------------------------------
class Recorder:
    """A policy that notes what each insert was told, over a real one."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.told: dict[bytes, tuple[int, bytes]] = {}

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        self.told[key] = (depth, parent)
        self.inner.insert(key, size, depth, parent)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def __contains__(self, key: object) -> bool:
        return key in self.inner  # type: ignore[operator]

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


@pytest.fixture
def told(monkeypatch: pytest.MonkeyPatch) -> Callable[[DiskTier], dict[bytes, tuple[int, bytes]]]:
    """Disk tiers built from here on record what their policy is told; ``told(tier)``."""
    import kvtier.tiers.disk.index as index

    real = index.make_policy
    monkeypatch.setattr(index, "make_policy", lambda name: Recorder(real(name)))
    return lambda tier: tier.policy.told  # type: ignore[attr-defined, no-any-return]


def test_a_record_leaves_the_chunk_bytes_alone(tmp_path: Path) -> None:
    (chain,) = chains("b", 1, 3)
    tier = open_tier(tmp_path, 8, "lru")
    assert tier.put(chain) == [True] * 3
    for e in chain:  # the file holds the chunk and nothing else; the record is beside it
        assert file_of(tier, e.key).read_bytes() == e.data
        raw = attr(file_of(tier, e.key))
        assert (raw is None) if e.depth == 0 else lineage.decode(raw, e.key) == (e.depth, e.parent)
    assert tier.get([e.key for e in chain]) == [e.data for e in chain]
    tier.close()


BAD = {
    "torn": lambda raw, other: raw[:20],
    "flipped": lambda raw, other: raw[:9] + bytes([raw[9] ^ 1]) + raw[10:],
    "another chunk's": lambda raw, other: other,
    "long": lambda raw, other: raw * 60,  # ~3 KB: as long as ext4 takes
    "empty": lambda raw, other: b"",
}


@pytest.mark.parametrize("damage", ["missing", *BAD])
def test_a_missing_or_bad_record_costs_the_parent_never_the_chunk(
        tmp_path: Path, told: Callable[[DiskTier], dict[bytes, tuple[int, bytes]]],
        caplog: pytest.LogCaptureFixture, damage: str) -> None:
    """A file an older version wrote (no record), a record torn or flipped, one that belongs to
    another chunk (an older version reused a victim's file) or planted: the chunk is indexed
    and served as before, with no parent (never a wrong one); a bad record is logged."""
    (chain,) = chains("d", 1, 3)
    tier = open_tier(tmp_path, 8, "prefix")
    assert tier.put(chain) == [True] * 3
    tier.close()
    victim, other = file_of(tier, chain[2].key), attr(file_of(tier, chain[1].key))
    raw = attr(victim)
    assert raw is not None and other is not None
    if damage == "missing":
        os.removexattr(victim, lineage.NAME)
    else:
        os.setxattr(victim, lineage.NAME, BAD[damage](raw, other))
    with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
        again = open_tier(tmp_path, 8, "prefix")
    assert told(again) == {chain[0].key: (0, b""), chain[1].key: (1, chain[0].key), chain[2].key: (0, b"")}
    assert again.get([e.key for e in chain]) == [e.data for e in chain]
    assert again.check(idle=True) == []
    logged = [r.getMessage() for r in caplog.records if "lineage record" in r.getMessage()]
    assert (logged == []) if damage == "missing" else (len(logged) == 1 and victim.name in logged[0])
    again.close()


def test_a_reused_victims_file_gets_the_new_record_or_none(tmp_path: Path) -> None:
    """A full tier renames a victim's file to overwrite it: the victim's record never stays
    on the new chunk (replaced by the new one's, or removed when the new chunk has none)."""
    tier = open_tier(tmp_path, 4, "lru")
    (first,) = chains("f", 1, 4)
    assert tier.put(first) == [True] * 4
    (linked,) = chains("g", 1, 2)
    roots = [Entry(k, chunk_for(k)) for k in (key_of("root0"), key_of("root1"))]
    assert tier.put(roots + linked) == [True] * 4  # every put reuses a victim's file
    assert tier.usage().evictions == 4
    for e in roots:
        assert attr(file_of(tier, e.key)) is None
    assert lineage.decode(attr(file_of(tier, linked[1].key)) or b"", linked[1].key) == (1, linked[0].key)
    tier.close()


def test_a_file_system_without_xattrs_keeps_its_puts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    def refused(*args: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(lineage.os, "setxattr", refused)
    (chain,) = chains("n", 1, 3)
    tier = open_tier(tmp_path / "nox", 8, "prefix")
    with caplog.at_level(logging.INFO, logger="kvtier.tiers.disk"):
        assert tier.put(chain) == [True] * 3
    assert [r.levelname for r in caplog.records if "no user xattrs" in r.getMessage()] == ["INFO"]
    assert tier.get([e.key for e in chain]) == [e.data for e in chain]
    assert tier.check(idle=True) == []
    tier.close()


# --- the decoder, fuzzed --------------------------------------------------------------------------
KEY, PARENT = key_of("fuzz-lineage"), key_of("fuzz-lineage-parent")
RECORD = lineage.encode(KEY, 7, PARENT)


def _reseal(raw: bytearray) -> bytes:
    """A forged record: the seal recomputed over whatever the body now says."""
    if len(raw) < lineage.SIZE:
        return bytes(raw)
    body = bytes(raw[: lineage.SIZE - 8])
    return body + lineage._seal(KEY, body) + bytes(raw[lineage.SIZE:])


@settings(max_examples=300, deadline=None)
@given(edits=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 16), st.integers(0, 255)),
                      min_size=1, max_size=4),
       reseal=st.booleans(), key=st.sampled_from([KEY, PARENT]))
def test_the_decoder_takes_only_a_sealed_record_of_its_own_key(edits: list[tuple[int, int, int]],
                                                               reseal: bool, key: bytes) -> None:
    """Bytes changed, cut or grown, with or without the seal recomputed, and read as the record
    of its own key or of another: decode raises BadLineage (nothing else), or returns exactly
    what a record says that :func:`encode` writes the same (never another parent than that)."""
    raw = bytearray(RECORD)
    for op, pos, value in edits:
        if op == 0 and raw:
            raw[pos % len(raw)] = value
        elif op == 1:
            del raw[pos % (len(raw) + 1):]
        else:
            raw += bytes([value]) * (1 + pos % 64)
    data = _reseal(raw) if reseal else bytes(raw)
    try:
        depth, parent = lineage.decode(data, key)
    except lineage.BadLineage as exc:
        assert str(exc)
        return
    assert lineage.encode(key, depth, parent) == data
    if not reseal:  # an unforged change never passes: only the record as written does
        assert (key, data) == (KEY, RECORD) and (depth, parent) == (7, PARENT)

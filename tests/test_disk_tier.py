"""Disk-tier faults on real files: restarts, torn and flipped files, foreign chunks, a full tier,
a full file system, an unusable directory, and two tier objects sharing one directory."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.chunk import HEADER_SIZE, decode_chunk, encode_chunk
from kvtier.config import DiskTierConfig
from kvtier.errors import ChunkError, TierUnavailableError
from kvtier.tiers.base import ABSENT, CORRUPT, EVICTED, Entry, Miss
from kvtier.tiers.disk import ALIGN, DiskTier, align_up
from kvtier.tiers.disk import direct_io as io
from tests.contract import NAMESPACE, chunk_for, key_of

MiB = 1 << 20


def open_tier(path: Path, capacity: int = 4 * MiB, **kw: object) -> DiskTier:
    # LRU explicitly: these tests name which chunks an eviction takes.
    kw.setdefault("policy", "lru")
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=capacity, **kw))  # type: ignore[arg-type]


def fill(tier: DiskTier, n: int, prefix: str = "k") -> list[bytes]:
    keys = [key_of(f"{prefix}{i}") for i in range(n)]
    assert tier.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * n
    return keys


@contextmanager
def small_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` mounted under ``tmp_path`` (skips where mounting needs a
    privilege this machine lacks), unmounted afterwards."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                      check=False, capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root in a VM or privileged container)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def file_of(tier: DiskTier, key: bytes) -> Path:
    return Path(tier.root) / key.hex()[:2] / f"{key.hex()}.kvc"


def test_restart_rebuilds_index(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = fill(tier, 10, prefix="old")
    time.sleep(0.05)  # file times are coarse (a few ms): make the two batches' order certain
    keys += fill(tier, 10, prefix="new")
    usage = tier.usage()
    tier.close()
    again = open_tier(tmp_path)
    assert again.rebuild_stats.files == 20 and again.rebuild_stats.bad == 0
    assert again.usage() == usage
    assert again.contains(keys) == 20
    assert again.get(keys) == [chunk_for(k) for k in keys]
    assert again.check(idle=True) == []
    # Older files are evicted first after a restart (file time order).
    small = open_tier(tmp_path, capacity=10 * ALIGN)
    assert small.rebuild_stats.evicted == 10 and small.usage().entries == 10
    assert small.contains(keys[10:]) == 10 and small.check(idle=True) == []


def test_truncated_file_is_a_corrupt_miss_and_deleted(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    keys = fill(tier, 3)
    path = file_of(tier, keys[1])
    os.truncate(path, 1000)
    assert tier.get(keys) == [chunk_for(keys[0]), Miss(CORRUPT), chunk_for(keys[2])]
    assert not path.exists() and tier.corrupt_reads == 1
    assert tier.get([keys[1]]) == [Miss(ABSENT)]
    assert tier.usage().entries == 2 and tier.check(idle=True) == []
    # Found at start-up: a length that disagrees with the header is deleted and counted.
    os.truncate(file_of(tier, keys[2]), 2000)
    tier.close()
    again = open_tier(tmp_path)
    assert again.rebuild_stats.bad == 1 and not file_of(again, keys[2]).exists()
    assert again.get(keys) == [chunk_for(keys[0]), Miss(ABSENT), Miss(ABSENT)]


@pytest.mark.parametrize("where", ["payload", "header"])
def test_bit_flip_is_a_corrupt_miss(tmp_path: Path, where: str) -> None:
    tier = open_tier(tmp_path)
    keys = fill(tier, 2)
    path = file_of(tier, keys[0])
    raw = bytearray(path.read_bytes())
    raw[HEADER_SIZE + 500 if where == "payload" else 40] ^= 0x01
    path.write_bytes(raw)
    out = memoryview(bytearray(8192))
    assert tier.get_into(keys, [out, memoryview(bytearray(8192))])[0] == Miss(CORRUPT)
    assert not path.exists() and tier.check(idle=True) == []
    assert tier.get(keys[1:]) == [chunk_for(keys[1])]
    if where == "header":  # start-up catches a bad header without reading payloads
        path2 = file_of(tier, keys[1])
        raw = bytearray(path2.read_bytes())
        raw[10] ^= 0xFF
        path2.write_bytes(raw)
        tier.close()
        assert open_tier(tmp_path).rebuild_stats.bad == 1 and not path2.exists()


def test_chunk_of_another_key_or_namespace(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    a, b = key_of("a"), key_of("b")
    other_ns = hashlib.sha256(b"another model").digest()
    foreign = bytes(encode_chunk(other_ns, a, "float16", (2, 2, 16, 2, 8), bytes(2048)))
    assert tier.put([Entry(a, foreign)]) == [True]
    got = tier.get([a])[0]
    assert got == foreign  # exact bytes; the store rejects the namespace
    with pytest.raises(ChunkError) as err:
        decode_chunk(got, namespace=NAMESPACE)  # type: ignore[arg-type]
    assert err.value.reason == "namespace_mismatch"
    # A put whose chunk carries another key is refused; a file copied under another key's
    # name is never served as that key.
    assert tier.put([Entry(b, chunk_for(a))]) == [False]
    assert tier.put([Entry(b, b"not a chunk at all" * 10)]) == [False]
    shutil.copy(file_of(tier, a), file_of(tier, b))
    assert tier.get([b]) == [Miss(CORRUPT)] and not file_of(tier, b).exists()
    assert tier.check(idle=True) == []


def test_full_tier_evicts_and_reuses_files(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity=8 * ALIGN)
    keys = fill(tier, 30)
    usage = tier.usage()
    assert usage.used_bytes <= usage.capacity_bytes and usage.entries == 8
    assert tier.get(keys[:22]) == [Miss(EVICTED)] * 22
    assert tier.get(keys[22:]) == [chunk_for(k) for k in keys[22:]]
    files = [p for p in Path(tier.root).rglob("*") if p.is_file()]
    assert len(files) == 8 and sum(p.stat().st_size for p in files) == usage.used_bytes
    assert tier.check(idle=True) == []


def test_unusable_directory_raises_at_construction(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    with pytest.raises(TierUnavailableError, match=str(blocker / "sub")):
        open_tier(blocker / "sub")


def test_two_tiers_on_one_directory_see_each_others_writes(tmp_path: Path) -> None:
    writer, reader = open_tier(tmp_path), open_tier(tmp_path)
    keys = fill(writer, 3)
    assert reader.contains(keys) == 3  # found on disk, then adopted into the reader's index
    assert reader.get(keys) == [chunk_for(k) for k in keys]
    late = fill(writer, 2, prefix="late")
    out = memoryview(bytearray(8192))
    assert reader.get_into(late[:1], [out]) == [len(chunk_for(late[0]))]
    assert reader.delete(keys[:1]) == 1
    assert writer.get(keys[:1]) == [Miss(EVICTED)]  # gone under the writer: a miss, no error
    assert reader.check(idle=True) == [] and writer.check(idle=True) == []
    # A buffered writer leaves unpadded files; an O_DIRECT reader reads them whole.
    buffered = open_tier(tmp_path, o_direct=False)
    odd = fill(buffered, 2, prefix="odd")
    assert os.path.getsize(file_of(buffered, odd[0])) % ALIGN
    assert reader.direct and reader.get(odd) == [chunk_for(k) for k in odd]
    big = key_of("odd-big")
    assert buffered.put([Entry(big, chunk_for(big, tokens=200))]) == [True]  # ~13 KiB, unpadded
    for out in (memoryview(mmap.mmap(-1, 8 * ALIGN)), memoryview(mmap.mmap(-1, 8 * ALIGN))[: 7 * ALIGN - 5]):
        assert reader.get_into([big], [out]) == [len(chunk_for(big, tokens=200))]
        assert bytes(out[: len(chunk_for(big, tokens=200))]) == chunk_for(big, tokens=200)
    # A different process works the same way.
    script = ("import sys; from kvtier.config import DiskTierConfig; from kvtier.tiers.disk import DiskTier;"
              "from tests.contract import chunk_for, key_of;"
              f"t = DiskTier(DiskTierConfig(path={str(tmp_path)!r}, capacity_bytes={4 * MiB}));"
              "k = key_of('other-process'); sys.exit(0 if t.put([__import__('kvtier.tiers.base').tiers.base"
              ".Entry(k, chunk_for(k))]) == [True] else 1)")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parent.parent, timeout=60)
    k = key_of("other-process")
    assert reader.get([k]) == [chunk_for(k)] and writer.contains([k]) == 1


def test_get_into_aligned_and_unaligned_buffers(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    key = key_of("align")
    chunk = chunk_for(key, tokens=200)  # spans several 4 KiB blocks with a partial tail
    assert len(chunk) % ALIGN and tier.put([Entry(key, chunk)]) == [True]
    arena = mmap.mmap(-1, 4 * align_up(len(chunk)))
    views = [memoryview(arena)[: len(chunk)],  # page-aligned, exact length
             memoryview(arena)[align_up(len(chunk)) : 3 * align_up(len(chunk))],  # aligned, roomy
             memoryview(bytearray(len(chunk) + 1))[1:]]  # unaligned
    for view in views:
        assert tier.get_into([key], [view]) == [len(chunk)]
        assert bytes(view[: len(chunk)]) == chunk
    with pytest.raises(ValueError):
        tier.get_into([key], [memoryview(arena)[: len(chunk) - 1]])
    assert tier.check(idle=True) == []


def test_stale_temp_files_are_removed(tmp_path: Path) -> None:
    tier = open_tier(tmp_path)
    fill(tier, 1)
    tier.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shard = tmp_path / "ab"
    stale = shard / f".{'ab' * 32}.{dead.pid}.0.tmp"
    live = shard / f".{'ab' * 32}.{os.getppid()}.0.tmp"  # a live writer's file stays
    old = shard / f".{'ab' * 32}.{os.getppid()}.1.tmp"
    # This pid's predecessor (a container's PID 1 restarted) left one: another token, stale;
    # one of this process's own (another tier object writing) stays.
    before = shard / f".{'ab' * 32}.{os.getpid()}-{'0' * 8}.2.tmp"
    mine = shard / f".{'ab' * 32}.{os.getpid()}-{io.WRITER_TOKEN}.3.tmp"
    for p in (stale, live, old, before, mine):
        p.write_bytes(b"partial")
    past = time.time() - 3600
    os.utime(old, (past, past))
    again = open_tier(tmp_path)
    assert again.rebuild_stats.tmp_removed == 3
    assert not stale.exists() and live.exists() and not old.exists()
    assert not before.exists() and mine.exists()
    assert again.usage().entries == 1


def test_full_file_system_evicts_and_retries(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ENOSPC from a real 1 MiB tmpfs while the tier believes it has 8 MiB."""
    with small_tmpfs(tmp_path, "1m") as mnt:
        tier = open_tier(mnt, capacity=8 * MiB)
        keys = [key_of(f"nospc{i}") for i in range(120)]
        with caplog.at_level(logging.WARNING, logger="kvtier.tiers.disk"):
            results = [tier.put([Entry(k, chunk_for(k, tokens=64))])[0] for k in keys]
        assert all(results), "ENOSPC must evict this tier's own files and retry"
        assert tier.usage().entries < len(keys)  # the file system, not the tier, was full
        assert tier.usage().used_bytes <= MiB < tier.usage().capacity_bytes
        assert tier.get(keys[-1:]) == [chunk_for(keys[-1], tokens=64)]
        assert tier.check(idle=True) == []
        tier.close()


def test_evict_listener_gets_the_bytes(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity=2 * ALIGN)
    seen: list[tuple[bytes, bytes]] = []
    tier.evict_listener = lambda k, v: seen.append((k, v))
    keys = fill(tier, 3)
    assert seen == [(keys[0], chunk_for(keys[0]))]
    tier.pin([keys[1]])
    d = key_of("d")
    assert tier.put([Entry(d, chunk_for(d))]) == [True]
    assert tier.contains([keys[1], d]) == 2 and tier.check(idle=True) == []


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_a_file_longer_than_its_chunk_is_refused_without_reading_it_all(tmp_path: Path, direct: bool) -> None:
    """A chunk file grown to 256 MiB (a planted or foreign file, sparse here) is a corrupt miss
    on both read paths, and reading it never grows the reader's scratch buffer past the chunk
    its header declares (the whole file used to be read into it, every page touched)."""
    from kvtier.chunk import page_aligned_buffer

    tier = open_tier(tmp_path, capacity=64 * MiB, o_direct=direct)
    keys = fill(tier, 2, prefix="long")
    for key in keys:
        os.truncate(file_of(tier, key), 256 * MiB)
    assert tier.get(keys[:1]) == [Miss(CORRUPT)]
    out = page_aligned_buffer(1 * MiB)
    assert tier.get_into(keys[1:], [out]) == [Miss(CORRUPT)]
    assert tier._scratch.view.nbytes <= 1 * MiB  # its smallest size: nothing past the chunks
    assert not any(file_of(tier, k).exists() for k in keys)  # refused files are removed
    assert tier.check(idle=True) == []


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_reading_a_sharers_chunk_into_a_full_tier_returns_that_chunk(tmp_path: Path, direct: bool) -> None:
    """Adopting a sharer's file makes room; the evict listener's read of the victim must not
    land in the buffer the first read's bytes are in (it did: get returned the victim's chunk)."""
    size = len(chunk_for(key_of("own0")))
    reader = open_tier(tmp_path, capacity=4 * (align_up(size) if direct else size), o_direct=direct)
    writer = open_tier(tmp_path, capacity=64 * ALIGN, o_direct=direct)
    seen: list[bytes] = []
    reader.evict_listener = lambda k, v: seen.append(k)  # as TieredStore installs one
    own = fill(reader, 4, "own")
    x, y = key_of("shared-x"), key_of("shared-y")
    assert writer.put([Entry(x, chunk_for(x)), Entry(y, chunk_for(y))]) == [True, True]
    assert reader.get([x]) == [chunk_for(x)]
    unaligned = memoryview(bytearray(len(chunk_for(y)) + 1))[1:]  # read via scratch, then copied
    assert reader.get_into([y], [unaligned]) == [len(chunk_for(y))]
    assert bytes(unaligned) == chunk_for(y)
    assert seen == own[:2] and reader.check(idle=True) == []


def test_a_bad_read_leaves_a_good_file_a_sharer_published_since(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The reader opened K's file; before it reads, the sharer reuses that file for another key
    and publishes a new K at the path. The reader's bad read must remove nothing but its inode."""
    from kvtier.tiers.disk import direct_io

    reader, sharer = open_tier(tmp_path, capacity=64 * ALIGN), open_tier(tmp_path, capacity=4 * ALIGN)
    k = key_of("K")
    assert sharer.put([Entry(k, chunk_for(k))]) == [True]
    fill(sharer, 3, "f")
    assert reader.contains([k]) == 1
    read_file = direct_io.read_file

    def sharer_moves_on(*args: object) -> object:
        monkeypatch.setattr(direct_io, "read_file", read_file)
        j = key_of("J")
        assert sharer.put([Entry(j, chunk_for(j))]) == [True]  # evicts K: its file reused for J
        assert sharer.put([Entry(k, chunk_for(k))]) == [True]  # K published again, a new file
        return read_file(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_io, "read_file", sharer_moves_on)
    assert reader.get([k]) == [Miss(CORRUPT)]  # it held J's chunk by then
    assert sharer.get([k]) == [chunk_for(k)] and reader.get([k]) == [chunk_for(k)]


def test_a_read_only_medium_never_raises_nor_leaks_capacity(tmp_path: Path) -> None:
    """A tmpfs remounted read-only under the tier: reads of a bad file, puts that must evict,
    deletes all answer (misses, False) without raising; once writable again, the whole
    capacity is usable (a put that failed used to keep its reservation for good)."""
    with small_tmpfs(tmp_path, "4m") as mnt:
        tier = open_tier(mnt, capacity=8 * ALIGN)
        keys = fill(tier, 8)
        path = file_of(tier, keys[0])
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE] ^= 1  # the payload's first byte
        path.write_bytes(bytes(data))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        assert tier.get(keys[:1]) == [Miss(CORRUPT)]
        new = [key_of(f"ro{i}") for i in range(3)]
        assert tier.put([Entry(k, chunk_for(k)) for k in new]) == [False] * 3
        assert tier.delete(keys[1:2]) == 1  # out of the index; the file stays where it cannot go
        assert tier.check(idle=True) == []
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        more = [key_of(f"rw{i}") for i in range(8)]
        assert tier.put([Entry(k, chunk_for(k)) for k in more]) == [True] * 8
        assert tier.usage().used_bytes == 8 * ALIGN and tier.check(idle=True) == []
        assert tier.get(more) == [chunk_for(k) for k in more]
        tier.close()


def test_an_evict_listener_that_raises_gives_the_reservation_back(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, capacity=4 * ALIGN)
    fill(tier, 4)

    def broken(key: bytes, value: bytes) -> None:
        raise RuntimeError("listener bug")

    tier.evict_listener = broken
    k = key_of("after")
    with pytest.raises(RuntimeError, match="listener bug"):
        tier.put([Entry(k, chunk_for(k))])
    tier.evict_listener = None
    more = [key_of(f"m{i}") for i in range(4)]
    assert tier.put([Entry(m, chunk_for(m)) for m in more]) == [True] * 4
    assert tier.usage().used_bytes == 4 * ALIGN and tier.check(idle=True) == []
    assert not [p for p in Path(tmp_path).rglob("*.tmp")]

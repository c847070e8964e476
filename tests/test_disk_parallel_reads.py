"""The disk tier's ``get_into`` reads a batch several files at a time (``read_threads``) when
its buffers take the bytes directly: results in key order, every miss with its reason, a
caller's too-small buffer refused only after every read ended, one bounded reader pool however
many tiers, no pool thread used for buffers that need the scratch path, and a forked child that
still reads. Real files, O_DIRECT and buffered."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier.chunk import HEADER_SIZE, page_aligned_buffer
from kvtier.config import DiskTierConfig
from kvtier.tiers.base import ABSENT, CORRUPT, EVICTED, Entry, Miss
from kvtier.tiers.disk import DiskTier, readers
from tests.contract import chunk_for, key_of

N = 12


def open_tier(path: Path, threads: int, direct: bool) -> DiskTier:
    return DiskTier(DiskTierConfig(path=str(path), capacity_bytes=64 << 20, policy="lru",
                                   o_direct=direct, read_threads=threads))


def file_of(tier: DiskTier, key: bytes) -> Path:
    return Path(tier.root) / key.hex()[:2] / f"{key.hex()}.kvc"


def damaged(tier: DiskTier) -> tuple[list[bytes], list[bytes | Miss]]:
    """N stored chunks of different sizes, one flipped on disk, one removed behind the
    tier's back, one never written; the keys and what a read must give for each."""
    keys = [key_of(f"p{i}") for i in range(N)]
    chunks = [chunk_for(k, tokens=8 + 40 * i) for i, k in enumerate(keys)]
    assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * N
    flipped = file_of(tier, keys[3])
    data = bytearray(flipped.read_bytes())
    data[HEADER_SIZE + 5] ^= 0xFF  # in the payload (an O_DIRECT file ends in padding)
    flipped.write_bytes(bytes(data))
    file_of(tier, keys[7]).unlink()
    want: list[bytes | Miss] = list(chunks)
    want[3], want[7] = Miss(CORRUPT), Miss(EVICTED)
    return [*keys, key_of("never")], [*want, Miss(ABSENT)]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("threads", [1, 4])
def test_batch_get_keeps_key_order_and_every_miss_reason(tmp_path: Path, threads: int, direct: bool) -> None:
    tier = open_tier(tmp_path, threads, direct)
    keys, want = damaged(tier)
    assert tier.get(keys) == want
    assert tier.check() == []
    tier.close()


@pytest.mark.parametrize("aligned", [True, False], ids=["page_aligned", "bytearray"])
@pytest.mark.parametrize("threads", [1, 4])
def test_batch_get_into_fills_each_buffer_with_its_own_chunk(tmp_path: Path, threads: int, aligned: bool) -> None:
    tier = open_tier(tmp_path, threads, direct=True)
    keys, want = damaged(tier)
    size = max(len(w) for w in want if isinstance(w, bytes)) + 8192
    outs = [page_aligned_buffer(size) if aligned else memoryview(bytearray(size)) for _ in keys]
    got = tier.get_into(keys, outs)
    for i, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, Miss):
            assert g == w, i
        else:
            assert g == len(w) and bytes(outs[i][:g]) == w, i
    tier.close()


def test_a_too_small_buffer_is_refused_after_every_read_ended(tmp_path: Path) -> None:
    tier = open_tier(tmp_path, 4, direct=False)
    keys = [key_of(f"s{i}") for i in range(8)]
    chunks = [chunk_for(k, tokens=64) for k in keys]
    assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 8
    outs = [memoryview(bytearray(len(c))) for c in chunks]
    outs[2] = memoryview(bytearray(len(chunks[2]) - 1))
    with pytest.raises(ValueError, match="too small"):
        tier.get_into(keys, outs)
    for i in (0, 1, *range(3, 8)):  # the other reads finished before the error was raised
        assert bytes(outs[i]) == chunks[i], i
    tier.close()


def test_tiers_share_one_bounded_reader_pool(tmp_path: Path) -> None:
    """A server holds a disk tier per tenant: 40 tiers reading batches at once must not make
    a thread pool each."""
    tiers = [open_tier(tmp_path / f"t{i}", 4, direct=False) for i in range(40)]
    batches = [fill(t, 6, f"t{i}-") for i, t in enumerate(tiers)]
    errors: list[BaseException] = []

    def reader(t: DiskTier, keys: list[bytes]) -> None:
        outs = [page_aligned_buffer(64 << 10) for _ in keys]
        try:
            for _ in range(5):
                assert not any(isinstance(v, Miss) for v in t.get_into(keys, outs))
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(t, k)) for t, k in zip(tiers, batches)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    pool = [t for t in threading.enumerate() if t.name.startswith("kvtier-disk-read")]
    assert 0 < len(pool) <= readers.POOL_THREADS
    for t in tiers:
        t.close()


def test_unaligned_buffers_under_o_direct_are_read_by_the_caller(tmp_path: Path) -> None:
    """A buffer O_DIRECT cannot read into goes through a scratch buffer, one per reading
    thread and as large as its largest chunk: such batches stay on the caller's thread."""
    tier = open_tier(tmp_path, 4, direct=True)
    keys = fill(tier, 6, "u")
    seen: set[str] = set()
    read = tier._read

    def spy(key: bytes, out: memoryview | None, adopt: bool = True) -> memoryview | Miss:
        seen.add(threading.current_thread().name)
        return read(key, out, adopt)

    tier._read = spy  # type: ignore[method-assign]
    outs = [page_aligned_buffer(80 << 10)[8:] for _ in keys]  # 8 bytes past a page boundary
    assert tier.get_into(keys, outs) == [len(chunk_for(k, tokens=64)) for k in keys]
    assert tier.get(keys) == [chunk_for(k, tokens=64) for k in keys]
    assert seen == {threading.current_thread().name}
    aligned = [page_aligned_buffer(64 << 10) for _ in keys]
    assert tier.get_into(keys, aligned) == [len(chunk_for(k, tokens=64)) for k in keys]
    assert any(name.startswith("kvtier-disk-read") for name in seen)
    tier.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_a_forked_child_reads_batches_with_a_pool_of_its_own(tmp_path: Path) -> None:
    """The child of a fork inherits the pool's bookkeeping but none of its threads; a batch
    read there must not wait forever for them."""
    tier = open_tier(tmp_path, 4, direct=False)
    keys = fill(tier, 8, "f")
    outs = [page_aligned_buffer(64 << 10) for _ in keys]
    want = [len(chunk_for(k, tokens=64)) for k in keys]
    assert tier.get_into(keys, outs) == want  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when the batch read completes and is right
        signal.alarm(20)
        ok = DiskTier(tier.config).get_into(keys, outs) == want
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tier.close()


def fill(tier: DiskTier, n: int, prefix: str) -> list[bytes]:
    keys = [key_of(f"{prefix}{i}") for i in range(n)]
    assert tier.put([Entry(k, chunk_for(k, tokens=64)) for k in keys]) == [True] * n
    return keys


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_pool_threads_run_where_the_first_tier_was_built(tmp_path: Path) -> None:
    """A vLLM worker builds its store on the cores its forward pass leaves free: the pool's
    threads must run there, not on the cores of whichever thread reads first. In a fresh
    process (the pool starts with the first tier)."""
    script = f"""
import os, threading
from kvtier.chunk import page_aligned_buffer
from kvtier.config import DiskTierConfig
from kvtier.tiers.base import Entry
from kvtier.tiers.disk import DiskTier
from tests.contract import chunk_for, key_of
everything = os.sched_getaffinity(0)
spare = {{max(everything)}}
os.sched_setaffinity(0, spare)               # build the tier on the spare CPU
tier = DiskTier(DiskTierConfig(path={str(tmp_path)!r}, capacity_bytes=64 << 20, read_threads=4))
os.sched_setaffinity(0, everything - spare)  # then read from the others
keys = [key_of(f"a{{i}}") for i in range(8)]
assert tier.put([Entry(k, chunk_for(k)) for k in keys]) == [True] * 8
outs = [page_aligned_buffer(64 << 10) for _ in keys]
assert tier.get_into(keys, outs) == [len(chunk_for(k)) for k in keys]
pool = [t for t in threading.enumerate() if t.name.startswith("kvtier-disk-read")]
assert pool and all(os.sched_getaffinity(t.native_id) == spare for t in pool), \\
    [(t.name, os.sched_getaffinity(t.native_id)) for t in pool]
print("ok")
"""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

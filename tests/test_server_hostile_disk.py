"""The disk tier (the library's, and so the server's per-tenant ones) against a local user who
plants things in its directory: symlinks posing as chunk files, directories and FIFOs with
chunk names, foreign files with chunk-like names; and its files' permissions. Issue 10
items 5, 6 and 7 (start-up). Real files in tmp directories, a real kvtier-server.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import DiskTierConfig, GrpcTierConfig
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.layout import chunk_path
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import make_chunk, make_keys, start_server

MiB = 1 << 20


@pytest.fixture
def umask0() -> Iterator[None]:
    old = os.umask(0)  # the most permissive umask: the tier alone must keep things private
    try:
        yield
    finally:
        os.umask(old)


def tier(root: Path, capacity: int = 1 * MiB) -> DiskTier:
    return DiskTier(DiskTierConfig(enabled=True, path=str(root), capacity_bytes=capacity, o_direct=False))


def test_planted_symlink_is_never_adopted_read_or_written_through(tmp_path: Path) -> None:
    """Item 5: a symlink with a chunk file's name, pointing at a file of the user's. The probe
    used to adopt it (os.stat) and eviction reused it, opening it O_WRONLY: the target was
    overwritten. Now it is not adopted, not read, and the target keeps its bytes."""
    keys = make_keys(40, seed=1)
    planted = keys[0]
    target = tmp_path / "precious.bin"
    target.write_bytes(make_chunk(planted, 100_000))  # even a valid chunk of that key
    original = target.read_bytes()
    t = tier(tmp_path / "disk", capacity=1 * MiB)
    try:
        os.symlink(target, chunk_path(t.root, planted))
        assert t.probe([planted]).hits == 0
        assert isinstance(t.get([planted])[0], Miss)
        for k in keys[1:]:  # ~4 MiB through a 1 MiB tier: every file is evicted and reused
            assert t.put([Entry(k, make_chunk(k, 100_000))]) == [True]
        assert t.check() == []
    finally:
        t.close()
    assert target.read_bytes() == original


def test_indexed_chunk_replaced_by_a_symlink_is_not_followed(tmp_path: Path) -> None:
    key, other = make_keys(2, seed=2)
    outside = tmp_path / "outside.kvc"
    outside.write_bytes(make_chunk(key, 5000))
    t = tier(tmp_path / "disk")
    try:
        assert t.put([Entry(key, make_chunk(key, 5000))]) == [True]
        path = chunk_path(t.root, key)
        os.unlink(path)
        os.symlink(outside, path)
        assert isinstance(t.get([key])[0], Miss)
        assert t.put([Entry(key, make_chunk(key, 5000))]) == [True]  # replaces the link itself
        assert not os.path.islink(path) and t.get([key]) == [make_chunk(key, 5000)]
        assert t.put([Entry(other, make_chunk(other, 5000))]) == [True]
    finally:
        t.close()
    assert outside.read_bytes() == make_chunk(key, 5000)


def test_files_0600_and_directories_0700_whatever_the_umask(tmp_path: Path, umask0: None) -> None:
    """Item 6: KV is user data. Every directory the tier makes (parents included) is 0700,
    every chunk file 0600, even with umask 0; an existing root is narrowed to 0700."""
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o777)
    for root in (tmp_path / "a" / "b" / "disk", existing):
        t = tier(root)
        try:
            keys = make_keys(3, seed=3)
            assert t.put([Entry(k, make_chunk(k, 3000)) for k in keys]) == [True] * 3
            dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
            files = [p for p in root.rglob("*") if p.is_file()]
            if root.name == "disk":
                dirs += [tmp_path / "a", tmp_path / "a" / "b"]
            assert len(files) == 3 and len(dirs) >= 257
            assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in dirs} == {"0o700"}
            assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}
        finally:
            t.close()
    old_file = next(p for p in existing.rglob("*.kvc"))
    old_file.chmod(0o644)  # as an older version left it
    tier(existing).close()  # start-up narrows what it indexes
    assert oct(stat.S_IMODE(old_file.stat().st_mode)) == "0o600"


def _plant(root: Path) -> dict[str, Path]:
    """Things a local user might leave in shard 'ab' of a tier directory."""
    shard = root / "ab"
    shard.mkdir(parents=True, exist_ok=True)
    name = "ab" + "11" * 31 + ".kvc"
    planted = {
        "dir_chunk": shard / name,
        "dir_tmp": shard / "x.tmp",
        "fifo": shard / ("ab" + "22" * 31 + ".kvc"),
        "foreign": shard / ("ab" + "33" * 31 + ".kvc"),
        "link": shard / ("ab" + "44" * 31 + ".kvc"),
    }
    planted["dir_chunk"].mkdir()
    planted["dir_tmp"].mkdir()
    os.mkfifo(planted["fifo"])
    planted["foreign"].write_bytes(b"my notes, not a kvtier chunk\n" * 10)
    os.symlink(planted["foreign"], planted["link"])
    return planted


def test_start_up_leaves_strangers_alone_and_does_not_hang(tmp_path: Path) -> None:
    """Item 7: a directory named like a chunk (or x.tmp) stopped start-up ('Is a directory'),
    a FIFO hung it, a foreign file with a chunk-like name was deleted. Now start-up finishes,
    leaves them all, and still deletes a damaged chunk file of its own."""
    root = tmp_path / "disk"
    t = tier(root)
    key = make_keys(1, seed=4)[0]
    assert t.put([Entry(key, make_chunk(key, 3000))]) == [True]
    t.close()
    ours = Path(chunk_path(str(root), key))
    damaged = bytearray(ours.read_bytes())
    ours.write_bytes(bytes(damaged[:-100]))  # a torn chunk of ours
    planted = _plant(root)
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(tier(root)), daemon=True)
    worker.start()
    worker.join(20)
    assert result, "start-up did not finish (blocked on a FIFO?)"
    t2 = result[0]
    assert isinstance(t2, DiskTier)
    try:
        assert all(os.path.lexists(p) for p in planted.values())
        assert planted["foreign"].read_bytes().startswith(b"my notes")
        assert not ours.exists() and t2.rebuild_stats.bad == 1 and t2.rebuild_stats.files == 0
    finally:
        t2.close()


def test_server_starts_over_a_planted_tenant_dir_and_writes_privately(tmp_path: Path) -> None:
    """The server's per-tenant disk tiers: same start-up and permission rules."""
    work = tmp_path / "srv"
    tenant_dir = work / "disk" / "tenants" / "default"
    planted = _plant(tenant_dir)
    s = start_server(work, "--disk-dir", "disk", "--disk-bytes", "16MiB", timeout=60)
    try:
        g = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,)))
        try:
            key = make_keys(1, seed=5)[0]
            assert g.put([Entry(key, make_chunk(key, 3000))]) == [True]
        finally:
            g.close()
        assert s.alive()
        path = Path(chunk_path(str(tenant_dir), key))
        assert oct(stat.S_IMODE(path.stat().st_mode)) == "0o600"
        assert oct(stat.S_IMODE(path.parent.stat().st_mode)) == "0o700"
        assert oct(stat.S_IMODE(tenant_dir.stat().st_mode)) == "0o700"
        assert all(os.path.lexists(p) for p in planted.values())
    finally:
        assert s.stop() == 0, s.log

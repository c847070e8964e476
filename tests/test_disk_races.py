"""One disk tier, several threads: what a read in flight must not undo.

A read that finds its key missing from the index adopts the file (another process wrote it).
It used to adopt a key this very tier deleted or evicted while the read was in flight: the key
came back with no file behind it (``contains`` said hit after ``delete`` returned, ``used_bytes``
counted bytes not on disk) and the adoption evicted a real chunk to make room for it. The read
is held open at a deterministic point (inside the real ``read_file``) while the other thread
deletes or evicts; ``check(idle=True)`` then also proves every indexed key has its file.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvtier.tiers.base import Entry
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk import direct_io as io
from tests.contract import chunk_for, key_of
from tests.test_disk_tier import file_of, fill, open_tier


@contextmanager
def read_held(monkeypatch: pytest.MonkeyPatch, tier: DiskTier, key: bytes) -> Iterator[threading.Event]:
    """A thread reading ``key``, held after its file is open and read, before the tier looks
    at its index again; set the yielded event to let it finish."""
    inside, go = threading.Event(), threading.Event()
    real = io.read_file

    def held(*args: Any, **kw: Any) -> Any:
        result = real(*args, **kw)
        if threading.current_thread().name == "held-reader":
            inside.set()
            assert go.wait(10)
        return result

    monkeypatch.setattr(io, "read_file", held)
    reader = threading.Thread(target=lambda: tier.get([key]), name="held-reader")
    reader.start()
    assert inside.wait(10)
    try:
        yield go
    finally:
        go.set()
        reader.join(10)
        monkeypatch.setattr(io, "read_file", real)


def _file_bytes(tmp_path: Path) -> int:
    """What one of the tests' chunks takes in a tier (its file, aligned where O_DIRECT is on)."""
    probe = open_tier(tmp_path / "probe")
    fill(probe, 1)
    return probe.usage().used_bytes


def test_a_key_deleted_while_read_is_not_adopted_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_tier(tmp_path / "d")
    (key,) = fill(tier, 1)
    with read_held(monkeypatch, tier, key):
        assert tier.delete([key]) == 1
    assert tier.contains([key]) == 0 and not file_of(tier, key).exists()
    assert tier.usage().entries == 0 and tier.usage().used_bytes == 0
    assert tier.check(idle=True) == []


def test_a_key_evicted_while_read_evicts_nothing_else(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tier = open_tier(tmp_path / "d", capacity=3 * _file_bytes(tmp_path))
    a, b, c = fill(tier, 3)  # full; a is the least recently used
    d = key_of("d")
    with read_held(monkeypatch, tier, a):
        assert tier.put([Entry(d, chunk_for(d))]) == [True]  # evicts a, whose read is in flight
    assert tier.contains([a]) == 0
    assert [tier.contains([k]) for k in (b, c, d)] == [1, 1, 1]  # no real chunk evicted for a
    assert tier.check(idle=True) == []


def test_overwriting_a_key_in_a_full_tier_evicts_nothing(tmp_path: Path) -> None:
    """The old file's bytes are freed by the overwrite itself (as the memory tier does)."""
    tier = open_tier(tmp_path / "d", capacity=3 * _file_bytes(tmp_path))
    keys = fill(tier, 3)
    assert tier.usage().evictions == 0
    assert tier.put([Entry(keys[0], chunk_for(keys[0]))]) == [True]
    assert tier.contains(keys) == 3 and tier.usage().evictions == 0
    tier.pin(keys)  # every byte pinned: an overwrite still fits in its own place
    assert tier.put([Entry(keys[1], chunk_for(keys[1]))]) == [True]
    assert tier.contains(keys) == 3 and tier.usage().evictions == 0
    assert tier.check(idle=True) == []


def test_a_probe_never_adopts_a_file_deleted_while_it_read_the_header(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A sharer's file (not in this tier's index) is probed; this tier deletes it completely
    while the probe holds the header it read: the probe must not index a file that is gone."""
    import kvtier.tiers.disk.tier as disk_tier

    writer, tier = open_tier(tmp_path / "d"), open_tier(tmp_path / "d")
    (key,) = fill(writer, 1)
    inside, go = threading.Event(), threading.Event()
    real = disk_tier.read_head

    def held(path: str) -> Any:
        out = real(path)
        inside.set()
        assert go.wait(10)
        return out

    monkeypatch.setattr(disk_tier, "read_head", held)
    prober = threading.Thread(target=lambda: tier.probe([key]))
    prober.start()
    assert inside.wait(10)
    monkeypatch.setattr(disk_tier, "read_head", real)
    assert tier.delete([key]) == 1  # the sharer's file: unlinked
    go.set()
    prober.join(10)
    assert tier.contains([key]) == 0 and tier.usage().entries == 0
    assert tier.check(idle=True) == []


def test_an_overwrite_whose_old_chunk_is_the_victim_stays_within_capacity(tmp_path: Path) -> None:
    tier = open_tier(tmp_path / "d", capacity=3 * _file_bytes(tmp_path))
    a, b, c = fill(tier, 3)  # full; a is the least recently used
    bigger = chunk_for(a, tokens=32)
    assert tier.put([Entry(a, bigger)]) == [True]  # room for the difference evicts a itself
    assert tier.usage().used_bytes <= tier.usage().capacity_bytes
    assert tier.get([a]) == [bigger] and tier.check(idle=True) == []

"""The SGLang backend's write-behind (connectors/kvtier_sglang/writebehind.py): each batch is
stored while the next is filled, a buffer set is never refilled while its store runs, and no
store is left reading the caller's buffers once the call returns. Real threads; ``fill`` and
``store`` are scripted (the real store path runs in tests/sglang_checks)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from kvtier_sglang.writebehind import write_behind

from kvtier.tiers.base import Entry


@pytest.fixture
def pool() -> Iterator[object]:
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as ex:
        yield ex


class Recorder:
    """fill/store that record what runs when; ``store`` takes ``delay`` s (a device write)."""

    def __init__(self, delay: float = 0.0, fail_at: int = -1) -> None:
        self.delay, self.fail_at = delay, fail_at
        self.lock = threading.Lock()
        self.storing: set[int] = set()  # sets whose store is in flight
        self.fills: list[tuple[int, int, int]] = []
        self.stored: list[bytes] = []
        self.most = 0
        self.overlapped = False  # a fill ran while a store was in flight

    def fill(self, first: int, n: int, which: int) -> list[Entry]:
        with self.lock:
            assert which not in self.storing, f"set {which} refilled while its store runs"
            self.overlapped |= bool(self.storing)
            self.fills.append((first, n, which))
        return [Entry(bytes([which]) + (first + k).to_bytes(31, "big"), b"x") for k in range(n)]

    def store(self, entries: list[Entry]) -> int:
        which = entries[0].key[0]
        with self.lock:
            self.storing.add(which)
            self.most = max(self.most, len(self.storing))
        try:
            time.sleep(self.delay)
            if self.fail_at >= 0 and any(int.from_bytes(e.key[1:], "big") == self.fail_at for e in entries):
                raise OSError(28, "No space left on device")
            with self.lock:
                self.stored += [e.key[1:] for e in entries]
            return len(entries) - (len(entries) > 2)  # a store may accept fewer than it got
        finally:
            with self.lock:
                self.storing.discard(which)


def test_batches_fill_in_order_rotate_through_the_sets_and_accepted_counts_add_up(pool) -> None:
    r = Recorder(delay=0.02)
    assert write_behind(r.fill, r.store, 10, 3, 2, pool) == 2 + 2 + 2 + 1
    assert r.fills == [(0, 3, 0), (3, 3, 1), (6, 3, 0), (9, 1, 1)]
    assert sorted(int.from_bytes(k, "big") for k in r.stored) == list(range(10))
    assert r.overlapped, "no batch was filled while an earlier one was being stored"


def test_a_ring_keeps_a_store_in_flight_per_set_and_never_refills_a_busy_one(pool) -> None:
    r = Recorder(delay=0.03)
    assert write_behind(r.fill, r.store, 12, 1, 4, pool) == 12
    assert [w for _, _, w in r.fills] == [0, 1, 2, 3] * 3
    assert r.most == 4


def test_one_set_stores_each_batch_before_the_next_is_filled(pool) -> None:
    r = Recorder(delay=0.01)
    assert write_behind(r.fill, r.store, 4, 1, 1, pool) == 4
    assert not r.overlapped and r.most == 1


def test_a_failing_store_reaches_the_caller_after_every_other_store_ended(pool) -> None:
    r = Recorder(delay=0.05, fail_at=1)
    with pytest.raises(OSError, match="No space"):
        write_behind(r.fill, r.store, 8, 1, 4, pool)
    assert not r.storing, "write_behind returned while a store still read the caller's buffers"


def test_a_failing_fill_waits_for_the_stores_in_flight(pool) -> None:
    r = Recorder(delay=0.2)
    real = r.fill

    def fill(first: int, n: int, which: int) -> list[Entry]:
        if first == 2:
            raise ValueError("page view out of range")
        return real(first, n, which)

    with pytest.raises(ValueError, match="out of range"):
        write_behind(fill, r.store, 4, 1, 4, pool)
    assert not r.storing and len(r.stored) == 2


def test_nothing_to_store_and_bad_arguments(pool) -> None:
    r = Recorder()
    assert write_behind(r.fill, r.store, 0, 4, 2, pool) == 0 and not r.fills
    for sets, per_batch in ((0, 1), (1, 0)):
        with pytest.raises(ValueError, match="at least one buffer set and one page per batch"):
            write_behind(r.fill, r.store, 1, per_batch, sets, pool)

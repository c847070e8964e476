"""The SGLang backend's read-ahead (connectors/kvtier_sglang/readahead.py): the next batch is read
while this one is copied, in order, never past a miss, and never left reading into a buffer
after the call returns. Real threads; ``load`` is a scripted source of pages (the real store
path runs in tests/sglang_checks/check_backend.py and check_tiers.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvtier_sglang.iothreads import IOThreads
from kvtier_sglang.readahead import read_ahead

from kvtier.cache import VerifiedRun
from kvtier.codec import Buf

PAGE = 64


def sets(size: int) -> tuple[list[memoryview], list[memoryview]]:
    return ([memoryview(bytearray(PAGE)) for _ in range(size)],
            [memoryview(bytearray(PAGE)) for _ in range(size)])


class Source:
    """Pages ``0..present-1`` exist; page ``i`` is ``PAGE`` bytes of ``i``. Records each load."""

    def __init__(self, present: int) -> None:
        self.present = present
        self.loads: list[tuple[int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, first: int, bufs: Sequence[memoryview]) -> VerifiedRun:
        with self.lock:
            self.loads.append((first, len(bufs)))
        payloads: list[Buf] = []
        for j, buf in enumerate(bufs):
            if first + j >= self.present:
                break
            buf[:] = bytes([first + j]) * PAGE
            payloads.append(buf)
        return VerifiedRun(payloads, [], {}, "absent" if len(payloads) < len(bufs) else "", PAGE * len(payloads))


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(2) as ex:
        yield ex


def test_pages_are_copied_in_order_and_nothing_past_a_miss_is_read(pool: ThreadPoolExecutor) -> None:
    src = Source(present=5)
    got: list[tuple[int, bytes]] = []
    end = read_ahead(src, lambda i, p: got.append((i, bytes(p))), 0, 12, sets(2), pool)
    assert end == 5
    assert got == [(i, bytes([i]) * PAGE) for i in range(5)]
    assert src.loads == [(0, 2), (2, 2), (4, 2)]  # batch [4, 5] came back short: no load of 6


def test_a_request_ending_mid_batch_and_one_starting_late(pool: ThreadPoolExecutor) -> None:
    src = Source(present=100)
    got: list[int] = []
    assert read_ahead(src, lambda i, p: got.append(i), 3, 10, sets(3), pool) == 10
    assert got == list(range(3, 10))
    assert src.loads == [(3, 3), (6, 3), (9, 1)]
    assert read_ahead(src, lambda i, p: got.append(i), 10, 10, sets(3), pool) == 10  # nothing to read


def test_the_next_batch_is_read_while_this_one_is_copied_into_the_other_set(pool: ThreadPoolExecutor) -> None:
    a, b = sets(1)
    started = threading.Event()
    inflight: list[int] = []
    src = Source(present=4)

    def load(first: int, bufs: Sequence[memoryview]) -> VerifiedRun:
        inflight.append(id(bufs[0].obj))
        if first == 1:
            started.set()
        return src(first, bufs)

    seen: list[tuple[int, int]] = []

    def copy(i: int, payload: Buf) -> None:
        if i == 0:  # page 1's read must be under way while page 0 is copied
            assert started.wait(5), "the next batch was not read during this batch's copy"
        owner = id(memoryview(payload).obj)
        seen.append((i, owner))
        assert bytes(payload) == bytes([i]) * PAGE  # not overwritten by the read in flight

    assert read_ahead(load, copy, 0, 4, (a, b), pool) == 4
    assert [o for _, o in seen] == [id(a[0].obj), id(b[0].obj)] * 2  # the sets alternate
    assert inflight == [o for _, o in seen]


def test_a_failing_copy_returns_only_after_the_read_in_flight_ended(pool: ThreadPoolExecutor) -> None:
    src = Source(present=8)
    ended = threading.Event()

    def load(first: int, bufs: Sequence[memoryview]) -> VerifiedRun:
        if first > 0:
            time.sleep(0.3)  # still reading into the other set when the copy fails
            ended.set()
        return src(first, bufs)

    def copy(i: int, payload: Buf) -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        read_ahead(load, copy, 0, 8, sets(2), pool)
    assert ended.is_set(), "read_ahead returned while a read still wrote into its buffers"


def test_a_failing_read_reaches_the_caller_after_the_pages_before_it(pool: ThreadPoolExecutor) -> None:
    src = Source(present=8)
    got: list[int] = []

    def load(first: int, bufs: Sequence[memoryview]) -> VerifiedRun:
        if first == 2:
            raise OSError(5, "EIO")
        return src(first, bufs)

    with pytest.raises(OSError, match="EIO"):
        read_ahead(load, lambda i, p: got.append(i), 0, 8, sets(2), pool)
    assert got == [0, 1]


def test_buffer_sets_of_different_sizes_or_too_few_are_refused(pool: ThreadPoolExecutor) -> None:
    a, b = sets(2)
    for bad in ((a, b[:1]), (a,), ()):
        with pytest.raises(ValueError, match="two or more buffer sets of one size"):
            read_ahead(Source(1), lambda i, p: None, 0, 1, bad, pool)


def test_a_ring_reads_several_batches_ahead_and_never_into_the_set_being_copied() -> None:
    ring = [sets(2)[0] for _ in range(4)]
    owner = {id(buf.obj): k for k, s in enumerate(ring) for buf in s}
    src = Source(present=19)
    lock = threading.Lock()
    busy: set[int] = set()  # sets being read into or copied out of
    loading, most = [0], [0]

    def load(first: int, bufs: Sequence[memoryview]) -> VerifiedRun:
        k = owner[id(bufs[0].obj)]
        with lock:
            assert k not in busy, f"set {k} read into while still in use"
            busy.add(k)
            loading[0] += 1
            most[0] = max(most[0], loading[0])
        time.sleep(0.02)  # a device read: the copies below overlap it
        run = src(first, bufs)
        with lock:
            loading[0] -= 1
        return run

    got: list[int] = []
    done_with: list[int] = []

    def copy(i: int, payload: Buf) -> None:
        assert bytes(payload) == bytes([i]) * PAGE
        got.append(i)
        if i % 2 == 1 or i == 18:  # the last page of its batch: its set is free again
            k = owner[id(memoryview(payload).obj)]
            with lock:
                busy.discard(k)
            done_with.append(k)

    with ThreadPoolExecutor(4) as ex:
        assert read_ahead(load, copy, 0, 30, ring, ex) == 19
    assert got == list(range(19))
    assert done_with[:8] == [0, 1, 2, 3, 0, 1, 2, 3]  # the sets in turn
    assert most[0] == 3, f"{most[0]} reads in flight at most; a ring of 4 reads 3 ahead"
    # Batch [18, 19] came back short: what was asked for after it is at most 2 batches more.
    assert max(first for first, _ in src.loads) <= 22


def test_a_closed_backends_readers_wait_for_the_read_in_flight_and_refuse_more() -> None:
    readers = IOThreads(threads=1)
    ended = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        ended.set()

    readers.pool().submit(slow)
    readers.close()
    assert ended.is_set(), "close returned while a read was still in flight"
    with pytest.raises(RuntimeError, match="closed"):
        readers.pool()
    readers.close()  # idempotent

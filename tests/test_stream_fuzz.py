"""Differential fuzz of kvtier/_stream.c's bounds checks against numpy's fallback (kvtier.strided).

tests/test_strided.py checks the copies on layouts that fit their buffers, and one run that
does not. Here the region's start, the run size and the offsets range over the whole signed
64-bit space as well (a page index gone wrong, a corrupt block table): the C loop and the
numpy path must give the same answer for every input, the same bytes and digest, or both a
ValueError before anything is written. The C loop's own entry points, given raw offsets, must
answer ValueError and nothing worse. A bound the C loop computed with wrapping signed
arithmetic once let a far ``start`` through: a read or write far outside the buffer (SIGSEGV),
where numpy refused.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import strided
from kvtier.strided import Runs, gather_into, runs_of, scatter_from

needs_c = pytest.mark.skipif(not strided.accelerated(), reason="kvtier._stream not built")
I64 = (1 << 63) - 1
starts = st.one_of(st.integers(0, 300), st.integers(0, I64), st.sampled_from([I64, I64 - 1, 1 << 62, (1 << 62) + 200]))


def _outcome(call, monkeypatch: pytest.MonkeyPatch, c_loop: bool) -> tuple:  # type: ignore[no-untyped-def]
    with monkeypatch.context() as m:
        if not c_loop:
            m.setattr(strided, "_STREAM", None)
        try:
            return ("ok", *call())
        except ValueError:
            return ("refused",)


@needs_c
@settings(max_examples=400, deadline=None)
@given(size=st.one_of(st.integers(0, 16), st.integers(0, 600)), start=starts,
       shape=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       strides=st.lists(st.one_of(st.integers(0, 200), st.integers(0, I64 // 8)), min_size=3, max_size=3),
       contiguous=st.booleans(), itemsize=st.sampled_from([1, 2, 8]))
def test_gather_and_scatter_agree_with_numpy_on_any_region(size: int, start: int, shape: list[int], strides: list[int],
                                                           contiguous: bool, itemsize: int) -> None:
    """``contiguous``: C-order strides, so the page is one run of all its bytes."""
    if contiguous:
        strides = [int(np.prod(shape[i + 1 :])) * itemsize for i in range(len(shape))]
    with pytest.MonkeyPatch.context() as monkeypatch:
        try:
            runs = runs_of(tuple(shape), tuple(strides[: len(shape)]), itemsize)
        except (ValueError, OverflowError):
            return
        src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()

        def gather() -> tuple:  # type: ignore[type-arg]
            dst = bytearray(runs.nbytes)
            digest = gather_into(dst, src, start, runs)
            return bytes(dst), digest

        def scatter() -> tuple:  # type: ignore[type-arg]
            dst = bytearray(size)
            scatter_from(dst, start, runs, bytes(range(256)) * (runs.nbytes // 256) + bytes(runs.nbytes % 256))
            return (bytes(dst),)

        for call in (gather, scatter):
            assert _outcome(call, monkeypatch, True) == _outcome(call, monkeypatch, False)


@needs_c
@settings(max_examples=400, deadline=None)
@given(size=st.integers(0, 300), start=st.one_of(st.integers(-2, 300), starts),
       run=st.one_of(st.integers(-1, 64), st.integers(1, I64), st.sampled_from([1 << 62, (1 << 62) + 1, I64])),
       offsets=st.lists(st.one_of(st.integers(-(1 << 63), I64), st.integers(-2, 300)), max_size=5))
def test_the_c_loop_refuses_any_run_outside_its_buffer(size: int, start: int, run: int, offsets: list[int]) -> None:
    """Raw offsets, start and run through the module's own entry points: a ValueError naming
    the problem, or a copy that stays inside both buffers (then numpy's copy agrees)."""
    from kvtier import _stream

    off = np.array(offsets, np.int64)
    src = bytes(range(256)) * (size // 256) + bytes(size % 256)
    inside = (run > 0 and start >= 0 and all(0 <= o and start + o + run <= size for o in offsets))
    flat = len(offsets) * run if inside else 0
    dst = bytearray(flat)
    try:
        _stream.gather(dst, src, start, off.data, run, False)
    except ValueError:
        assert not inside
    else:
        assert inside
        want = b"".join(src[start + o : start + o + run] for o in offsets)
        assert bytes(dst) == want
    big = bytearray(size)
    try:
        _stream.scatter(big, start, off.data, bytes(flat), run)
    except ValueError:
        assert not inside
    else:
        assert inside


@needs_c
@pytest.mark.parametrize(("start", "run", "n"), [(I64, 200, 1), ((1 << 62) + 200, 1 << 62, 4), (I64, I64, 1),
                                                  (0, 1 << 62, 4), (1 << 62, 1 << 61, 2)])
def test_far_starts_and_huge_runs_are_refused(start: int, run: int, n: int) -> None:
    """The cases that crashed: each a ValueError, nothing read or written."""
    from kvtier import _stream

    off = np.zeros(n, np.int64)
    with pytest.raises(ValueError):
        _stream.gather(bytearray(0), bytes(100), start, off.data, run, False)
    with pytest.raises(ValueError):
        _stream.scatter(bytearray(100), start, off.data, bytes(0), run)
    if n * run < 1 << 20:  # through the public API too (a buffer of the runs' size)
        with pytest.raises(ValueError):
            gather_into(bytearray(n * run), bytes(100), start, Runs(run, (n,), (0,), off))

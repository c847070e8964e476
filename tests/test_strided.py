"""kvtier.strided: page runs and the copies over them, the C loop (kvtier._stream) against
numpy's strided copy and xxhash, on random shapes, layouts, offsets and run sizes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import strided
from kvtier.strided import Runs, gather_into, runs_of, scatter_from

C_LOOP = pytest.param(True, id="c-loop", marks=pytest.mark.skipif(not strided.accelerated(),
                                                                   reason="kvtier._stream not built"))
BOTH = [C_LOOP, pytest.param(False, id="numpy")]


@pytest.fixture(params=BOTH)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test through the C loop and through the numpy fallback."""
    if not request.param:
        monkeypatch.setattr(strided, "_STREAM", None)
    return bool(request.param)


def page_of(pool: np.ndarray, perm: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """A page the way the connectors view one: a slice of the pool's second axis, permuted."""
    return pool[:, lo:hi].transpose(perm)


def start_of(view: np.ndarray, pool: np.ndarray) -> int:
    return int(view.__array_interface__["data"][0] - pool.__array_interface__["data"][0])


layouts = st.tuples(st.integers(1, 3), st.integers(1, 24), st.integers(1, 4), st.sampled_from([1, 2, 4, 8]),
                    st.permutations(range(4)), st.sampled_from([np.int8, np.int16, np.float32]),
                    st.integers(0, 2))


# The fixture only picks the copy path; nothing in it changes between examples.
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layout=layouts)
def test_gather_and_scatter_move_exactly_the_page(path: bool, layout: tuple) -> None:
    kv, slots, heads, dim, perm, dtype, lo = layout
    rng = np.random.default_rng(slots * 31 + dim)
    pool = rng.integers(-100, 100, size=(kv, slots + 3, heads, dim)).astype(dtype)
    view = page_of(pool, tuple(perm), lo, lo + slots)
    runs = runs_of(view.shape, view.strides, view.itemsize)
    assert runs.nbytes == view.nbytes
    out = bytearray(view.nbytes)
    digest = gather_into(out, pool, start_of(view, pool), runs)
    want = np.ascontiguousarray(view).tobytes()
    assert bytes(out) == want
    assert digest == xxhash.xxh3_64_intdigest(want)
    back = np.zeros_like(pool)
    scatter_from(back, start_of(view, pool), runs, out)
    expect = np.zeros_like(pool)
    expect[:, lo:lo + slots] = pool[:, lo:lo + slots]
    assert np.array_equal(back, expect)  # the page's bytes, and nothing outside it


def test_runs_merge_the_contiguous_tail() -> None:
    pool = np.zeros((2, 10, 3, 4), np.int16)
    assert runs_of(pool.shape, pool.strides, 2).run == pool.nbytes          # one run
    view = pool[:, 2:6].transpose(2, 0, 1, 3)                                  # runs of one head
    runs = runs_of(view.shape, view.strides, 2)
    assert (runs.run, runs.shape, len(runs.offsets)) == (8, (3, 2, 4), 24)
    assert runs.span <= pool.nbytes


@pytest.mark.parametrize("n", [1, 4095, (128 << 10) - 1, 128 << 10, (128 << 10) + 1, 3 << 20])
def test_long_runs_cross_the_bounce_buffer(path: bool, n: int) -> None:
    src = np.frombuffer(np.random.default_rng(n).bytes(2 * n + 7), np.uint8)
    runs = Runs(run=n, shape=(2,), strides=(n + 7,), offsets=np.array([0, n + 7], np.int64))
    out = np.empty(2 * n, np.uint8)
    for start in (0, 1) if n > 1 else (0,):  # unaligned sources too
        if start + runs.span > src.nbytes:
            continue
        digest = gather_into(out, src, start, runs)
        want = np.concatenate([src[start:start + n], src[start + n + 7:start + 2 * n + 7]])
        assert np.array_equal(out, want) and digest == xxhash.xxh3_64_intdigest(want)


def test_a_run_outside_its_buffer_is_refused_before_any_copy(path: bool) -> None:
    src = np.arange(64, dtype=np.uint8)
    runs = Runs(run=16, shape=(2,), strides=(40,), offsets=np.array([0, 40], np.int64))
    out = bytearray(32)
    with pytest.raises(ValueError, match="leave"):
        gather_into(out, src, 16, runs)          # the second run would end at byte 72 of 64
    assert out == bytearray(32)
    dst = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="leave"):
        scatter_from(dst, 16, runs, bytes(range(32)))
    assert not dst.any()


def test_a_size_mismatch_names_both(path: bool) -> None:
    runs = runs_of((4,), (1,), 1)
    with pytest.raises(ValueError, match="dst is 3 bytes; the runs are 4"):
        gather_into(bytearray(3), bytes(4), 0, runs)
    with pytest.raises(ValueError, match="src is 5 bytes; the runs are 4"):
        scatter_from(bytearray(4), 0, runs, bytes(5))


@pytest.mark.skipif(not strided.accelerated(), reason="kvtier._stream not built")
def test_the_c_loop_checks_what_it_is_given() -> None:
    from kvtier import _stream

    with pytest.raises(ValueError, match="int64"):
        _stream.gather(bytearray(4), bytes(4), 0, np.zeros(1, np.int32), 4, True)
    with pytest.raises(ValueError, match="positive"):
        _stream.scatter(bytearray(4), -1, np.zeros(1, np.int64), bytes(4), 4)
    with pytest.raises(BufferError):
        _stream.scatter(bytes(4), 0, np.zeros(1, np.int64), bytes(4), 4)   # read-only destination


def test_ci_builds_the_c_loop() -> None:
    """Where CI runs (a C compiler present), the accelerator must be built and agree with
    xxhash, or every c-loop case above would skip unseen."""
    if not strided.accelerated():
        assert not os.environ.get("CI"), "kvtier._stream was not built or failed its self-check"
        pytest.skip("kvtier._stream not built here (optional accelerator)")

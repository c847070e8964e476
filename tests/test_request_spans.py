"""kvtier.tiers.remote.batching.request_spans: a data-path verb's requests cover every key once,
in order, within the key count and, on shared memory, within the segment's bytes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier.protocol.wire import placed_bytes as placed
from kvtier.tiers.remote.batching import request_spans


@given(sizes=st.lists(st.integers(0, 5000), max_size=60), most=st.integers(1, 10), room=st.integers(-1, 20000))
def test_spans_cover_in_order_within_both_bounds(sizes: list[int], most: int, room: int) -> None:
    spans = request_spans(sizes, most, room)
    assert [i for a, b in spans for i in range(a, b)] == list(range(len(sizes)))  # each once, in order
    for a, b in spans:
        assert 1 <= b - a <= most
        if room > 0 and b - a > 1:
            assert sum(placed(n) for n in sizes[a:b]) <= room
    # greedy: a span ends only where the next item would break a bound
    for (a, b), _ in zip(spans, spans[1:]):
        assert b - a == most or (room > 0 and sum(placed(n) for n in sizes[a : b + 1]) > room)


def test_large_requests_are_cut_to_the_segment() -> None:
    mib = 1 << 20
    assert request_spans([4 * mib + 128] * 64, 64, 32 * mib) == [(i, i + 7) for i in range(0, 63, 7)] + [(63, 64)]
    assert request_spans([mib] * 8, 64, 32 * mib) == [(0, 8)]  # fits: one request, as before
    assert request_spans([40 * mib, mib], 64, 32 * mib) == [(0, 1), (1, 2)]  # too big for it: alone
    assert request_spans([mib] * 5, 2, 0) == [(0, 2), (2, 4), (4, 5)]  # no segment: key count only


def test_most_must_be_positive() -> None:
    with pytest.raises(ValueError, match="most must be at least 1, got 0"):
        request_spans([1], 0, 0)

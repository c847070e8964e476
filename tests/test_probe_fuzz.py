"""Differential fuzz of kvtier/_probe.c (a tier probe's key check and leading run) against its
Python reference (kvtier.tiers.base.check_keys_python / leading_run_python).

tests/test_probe_loops.py checks each refusal with one bad key in a list of good ones. Here the
lists mix keys of every width with values that are not keys at all (str, int, None, bytearray,
memoryview), in any order: both loops must give the same answer, the same error class and,
where the keys leave only one possible message, the same message. The C loop once answered
ValueError for a list whose first bad key was too short and a later one a str, where Python
(which checks every key's type first) answers TypeError.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.tiers import base

needs_c = pytest.mark.skipif(base.C_PROBE is None, reason="kvtier._probe not built here (optional accelerator)")
keys = st.one_of(
    st.binary(min_size=32, max_size=32), st.binary(max_size=40), st.binary(max_size=40).map(bytearray),
    st.binary(min_size=32, max_size=32).map(lambda b: memoryview(b)), st.text(min_size=32, max_size=32),
    st.integers(), st.none())


def _outcome(call: Callable[[], object]) -> tuple[str, object]:
    try:
        return "ok", call()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)


@needs_c
@settings(max_examples=600, deadline=None)
@given(batch=st.lists(keys, max_size=8))
def test_check_keys_c_and_python_agree(batch: list[object]) -> None:
    assert base.C_PROBE is not None
    check = base.C_PROBE[0]
    got = _outcome(lambda: check(batch, base.KEY_BYTES))  # type: ignore[arg-type]
    want = _outcome(lambda: base.check_keys_python(batch))  # type: ignore[arg-type]
    assert got[0] == want[0], (got, want)
    bad_widths = {len(k) for k in batch if isinstance(k, (bytes, bytearray, memoryview)) and len(k) != 32}
    if want[0] == "TypeError" or len(bad_widths) <= 1:  # (Python names one bad width of several)
        assert got == want


@needs_c
@settings(max_examples=400, deadline=None)
@given(batch=st.lists(keys, max_size=8), held=st.lists(st.integers(0, 7), max_size=8),
       container=st.sampled_from([dict, set, frozenset, list]))
def test_leading_run_c_and_python_agree(batch: list[object], held: list[int], container: type) -> None:
    assert base.C_PROBE is not None
    chosen = [batch[i] for i in held if i < len(batch) and not isinstance(batch[i], (bytearray, memoryview))]
    index = dict.fromkeys(chosen) if container is dict else container(chosen)
    assert _outcome(lambda: base.C_PROBE[1](index, batch)) == _outcome(  # type: ignore[index, arg-type]
        lambda: base.leading_run_python(index, batch))  # type: ignore[arg-type]


@needs_c
@pytest.mark.parametrize("later", ["k" * 32, 7, None])
def test_a_key_that_is_not_bytes_is_the_type_error_wherever_it_is(later: object) -> None:
    batch = [b"x" * 31, later]
    assert base.C_PROBE is not None
    with pytest.raises(TypeError, match="chunk keys are bytes, got"):
        base.C_PROBE[0](batch, base.KEY_BYTES)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="chunk keys are bytes, got"):
        base.check_keys_python(batch)  # type: ignore[arg-type]

"""The probe loops of kvtier.tiers.base: the optional C module (kvtier/_probe.c) answers exactly
as the Python fallback does, and the public helpers keep their contract whichever runs."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pytest

from kvtier.tiers import base
from kvtier.tiers.base import check_keys, check_keys_python, leading_run, leading_run_python


def _c_probe() -> tuple[Callable[[Sequence[bytes], int], None], Callable[..., int]]:
    if base.C_PROBE is None:
        # CI builds it (same machine image: gcc); elsewhere it is optional.
        assert not os.environ.get("CI"), "kvtier._probe was not built: pip install -e . with a C compiler"
        pytest.skip("kvtier._probe not built here (optional accelerator)")
    return base.C_PROBE


KEYS = [bytes([i]) * 32 for i in range(40)]


@pytest.mark.parametrize("held", [set(), {0}, set(range(40)), set(range(17)), set(range(1, 40)), {0, 1, 2, 5}])
@pytest.mark.parametrize("container", [dict, set, frozenset, list])
def test_leading_run_c_equals_python(held: set[int], container: type) -> None:
    _, c_leading_run = _c_probe()
    members = [KEYS[i] for i in sorted(held)]
    index = dict.fromkeys(members, 0) if container is dict else container(members)  # 0: a falsy value is held too
    for keys in (KEYS, tuple(KEYS), KEYS[:0], KEYS[3:]):
        want = leading_run_python(index, keys)
        assert c_leading_run(index, keys) == want == leading_run(index, keys)
        assert want == next((i for i, k in enumerate(keys) if k not in index), len(keys))


@pytest.mark.parametrize("keys", [[], KEYS, tuple(KEYS), [bytearray(32), memoryview(bytes(32))]])
def test_check_keys_accepts_32_byte_keys(keys: Sequence[bytes]) -> None:
    c_check_keys, _ = _c_probe()
    c_check_keys(keys, 32)
    check_keys_python(keys)
    check_keys(keys)


@pytest.mark.parametrize("bad", [b"", b"x" * 31, b"x" * 33, bytearray(31)])
@pytest.mark.parametrize("at", [0, 1, 39])
def test_check_keys_refuses_any_other_width_wherever_it_is(bad: bytes, at: int) -> None:
    c_check_keys, _ = _c_probe()
    keys = list(KEYS)
    keys[at] = bad
    message = f"chunk keys are 32 bytes, got one of {len(bad)}"
    for check in (lambda k: c_check_keys(k, 32), check_keys_python, check_keys):
        with pytest.raises(ValueError, match=message):
            check(keys)


@pytest.mark.parametrize("bad", ["k" * 32, list(range(32)), 7])
def test_check_keys_refuses_what_is_not_bytes(bad: object) -> None:
    """A 32-character str has the right len(): it was stored by the memory and cpu tiers and
    made the disk tier fail with AttributeError."""
    c_check_keys, _ = _c_probe()
    keys = [*KEYS[:3], bad]
    for check in (lambda k: c_check_keys(k, 32), check_keys_python, check_keys):
        with pytest.raises(TypeError, match="chunk keys are bytes, got"):
            check(keys)


def test_c_loops_refuse_what_python_refuses() -> None:
    c_check_keys, c_leading_run = _c_probe()
    with pytest.raises(TypeError):
        c_check_keys([KEYS[0], 7], 32)  # no len()
    with pytest.raises(TypeError):
        c_check_keys(None, 32)  # not a sequence
    with pytest.raises(TypeError):
        c_leading_run({}, None)
    with pytest.raises(TypeError):
        c_leading_run({}, [[1]])  # unhashable, as `[1] in {}` is
    assert c_leading_run(set(), iter(KEYS)) == 0  # an iterable is read through, as takewhile would

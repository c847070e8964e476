"""kvtier.labelcap: the first N distinct label values keep their name, the rest share "other"."""

from __future__ import annotations

import threading

import pytest

from kvtier.labelcap import OTHER, LabelCap


def test_first_values_kept_rest_other_and_stable() -> None:
    cap = LabelCap(2)
    assert [cap("a"), cap("b"), cap("c"), cap("a"), cap("d"), cap("b")] == ["a", "b", OTHER, "a", OTHER, "b"]
    assert cap.kept == frozenset({"a", "b"})


def test_zero_limit_sends_everything_to_other() -> None:
    assert LabelCap(0)("tenant-1") == OTHER


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_limit_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="limit"):
        LabelCap(bad)  # type: ignore[arg-type]


def test_non_string_value_is_refused() -> None:
    with pytest.raises(TypeError, match="str"):
        LabelCap(3)(7)  # type: ignore[arg-type]


def test_fold_sums_overflowed_values() -> None:
    cap = LabelCap(1)
    assert cap.fold({"x": 1, "y": 2, "z": 3}) == {"x": 1, OTHER: 5}
    assert cap.fold([("y", 1.5), ("x", 1)]) == {OTHER: 1.5, "x": 1}


def test_concurrent_admission_never_exceeds_limit() -> None:
    cap = LabelCap(10)
    seen: list[str] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        out = [cap(f"t{base * 100 + i}") for i in range(100)]
        with lock:
            seen.extend(out)

    threads = [threading.Thread(target=worker, args=(b,)) for b in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(cap.kept) == 10
    assert set(seen) - {OTHER} == cap.kept

"""Tiny shared helpers for bench scripts: time repeats, summarise them as min/median/max, read
another process's CPU time.

Benches print human lines with :func:`fmt` and end with one JSON line; ratios are taken from
medians measured in the same run (never asserted in tests).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Stats:
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("no measurements to summarise")
        return cls(min(values), statistics.median(values), max(values))


def fmt(values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """``min a / median b / max c unit (n=N)``."""
    s = Stats.of(values)
    tail = f" {unit}" if unit else ""
    return (f"min {s.min:.{digits}f} / median {s.median:.{digits}f} / max {s.max:.{digits}f}"
            f"{tail} (n={len(values)})")


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` took (perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return Stats.of(values).median


def process_cpu_s(pid: int) -> float:
    """CPU seconds the live threads of process ``pid`` have run (Linux ``schedstat``; a thread
    that has ended no longer counts, so read it around work whose threads outlive it)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return total / 1e9

"""kvtier analyze: the replay order (timestamp order, whatever the file's) and the TTL clock.

A log whose lines are out of timestamp order (two replicas' logs concatenated, a reversed
export) must give the figures of the same log in order, and say how many were out of order.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.analyze import analysis, readers, replay
from kvtier.analyze.records import Request, time_order
from tests.test_analyze import random_token_log


def _write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _figures(doc: dict[str, Any]) -> tuple[Any, ...]:
    return (doc["bound"], doc["curve"], doc["ttl"], doc["by_tenant"], doc["log"]["duration_s"])


@pytest.mark.parametrize("shuffle", ["reversed", "two_replicas", "random"])
def test_out_of_order_log_gives_the_in_order_figures(tmp_path: Path, shuffle: str) -> None:
    """Distinct timestamps (no ties), so the order in time is the only order: the file's must
    not matter. The TTLs (3 s, 20 s) sit between the gaps, so a file-order replay differs."""
    rng = random.Random(7)
    logs = random_token_log(4, n=120)
    t = 0.0
    rows: list[dict[str, object]] = []
    for i, toks in enumerate(logs):
        t += rng.choice((0.5, 4.0, 30.0))
        rows.append({"tokens": toks, "timestamp": t, "tenant": f"t{i % 3}"})
    if shuffle == "reversed":
        moved = rows[::-1]
    elif shuffle == "two_replicas":  # each replica's log in order, one after the other
        moved = rows[0::2] + rows[1::2]
    else:
        moved = rows[:]
        rng.shuffle(moved)
    opts = analysis.Options(capacities=(2, 5, 20), policies=("lru", "belady", "s3fifo"), ttls=(3.0, 20.0))
    want = analysis.analyze(readers.read_log(_write(tmp_path / "in.jsonl", rows), chunk_tokens=2), opts)
    log = readers.read_log(_write(tmp_path / "out.jsonl", moved), chunk_tokens=2)
    got = analysis.analyze(log, opts)
    assert _figures(got) == _figures(want)
    assert want["log"]["out_of_order"] == 0 and got["log"]["out_of_order"] > 0
    # the requests keep their file position as ``index``, and are in time order
    assert sorted(r.index for r in log.requests) == list(range(len(rows)))
    stamps = [r.timestamp for r in log.requests if r.timestamp is not None]
    assert len(stamps) == len(rows) and stamps == sorted(stamps)


def test_time_order_is_stable_and_counts_late_requests() -> None:
    def req(i: int, ts: float | None) -> Request:
        return Request(i, (bytes([i]),), 1, 1, timestamp=ts)

    # no timestamp: keeps its place after the request before it (or first, before any)
    reqs = [req(0, None), req(1, 5.0), req(2, None), req(3, 5.0), req(4, 2.0), req(5, 9.0), req(6, 2.0)]
    ordered, late = time_order(reqs)
    assert [r.index for r in ordered] == [0, 4, 6, 1, 2, 3, 5]
    assert late == 2  # requests 4 and 6 are earlier than request 1
    in_order = [req(0, 1.0), req(1, 1.0), req(2, None), req(3, 2.0)]
    same, none_late = time_order(in_order)
    assert same is in_order and none_late == 0  # the usual case: no copy


def test_ttl_clock_never_moves_backwards(tmp_path: Path) -> None:
    """``with_ttl`` on requests not in time order: an earlier timestamp is taken at the latest
    time so far, so it neither counts a negative age as a hit nor sets a chunk's last use back
    (which made request 3 miss: 1005 - 10 > 60)."""
    p = _write(tmp_path / "t.jsonl", [{"tokens": list(range(8)), "timestamp": ts} for ts in (0, 1000, 10, 1005)])
    reqs = readers.read_log(p, chunk_tokens=4).requests
    file_order = sorted(reqs, key=lambda r: r.index)
    assert replay.with_ttl(file_order, 60).tolist() == [0, 0, 8, 8]
    assert replay.with_ttl(reqs, 60).tolist() == [0, 8, 0, 8]  # the reader's order: 0, 10, 1000, 1005


def test_cli_says_the_log_was_out_of_order(tmp_path: Path) -> None:
    rows = [{"tokens": [1, 2, 3, 4], "timestamp": ts} for ts in (3, 1, 2, 4)]
    p = _write(tmp_path / "late.jsonl", rows)
    cmd = [sys.executable, "-m", "kvtier.cli", "analyze", str(p), "-q", "--chunk-tokens", "2", "--policies", "lru"]
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["log"]["out_of_order"] == 2
    assert "2 of 4 requests are earlier than a request before them" in r.stderr
    s = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert "2 requests were out of timestamp order in the file: replayed in timestamp order" in s.stdout

"""bench/tenant_flood.py runs end to end at a small size against the real kvtier-server it
starts, for both floods, and its last line carries the keys the docs quote (the figures
themselves belong to the bench, not to a test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "tenant_flood.py"


@pytest.mark.parametrize("flood", ["get", "put"])
def test_the_bench_runs_and_reports_its_keys(flood: str) -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--flood", flood, "--streams", "2", "--chunks", "4",
                          "--chunk-bytes", "100000", "--calls", "5", "--repeats", "1"],
                         capture_output=True, text=True, timeout=240, check=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert set(last) == {"lookup_p50_flood_vs_idle", "lookup_p95_flood_vs_idle", "get_p50_flood_vs_idle",
                         f"flood_{flood}_gbps", "streams", "flood"}
    assert last[f"flood_{flood}_gbps"] > 0 and last["streams"] == 2

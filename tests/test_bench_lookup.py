"""bench/_lookup_latency.py against a real kvtier-server: every path is timed, each call is a
full hit, and the JSON keys bench/remote.py prints are there. A few calls only (the figures
themselves are not asserted: they belong to the bench)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.kvtier_servers import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _lookup_latency import PATHS, measure_lookups, summary  # noqa: E402


def test_lookup_latency_times_every_path_and_names_the_keys(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--cpu-bytes", "32MiB", "--slot-bytes", "80KiB")
    try:
        lat = measure_lookups(server.address, calls=60, chunks=4, chunk_bytes=64 << 10, warmup=3)
        assert set(lat) == set(PATHS) and all(len(v) == 60 and min(v) > 0 for v in lat.values())
        out = summary(lat)
        for p in ("grpc", "data_path", "client", "client_grpc"):
            s = out[f"lookup_us_{p}"]
            assert s["min"] <= s["median"] <= s["max"]
        assert out["lookup_data_path_vs_grpc"] == out["lookup_us_data_path"]["median"] / \
            out["lookup_us_grpc"]["median"]
        assert 'method="data.Lookup"' in server.metrics()  # the data path really served some
    finally:
        assert server.stop() == 0, server.log


def test_lookup_latency_refuses_a_node_without_a_data_path(tmp_path: Path) -> None:
    server = start_server(tmp_path, ports=("--port", "0", "--http-port", "-1", "--data-port", "-1"))
    try:
        with pytest.raises(RuntimeError, match="no data path"):
            measure_lookups(server.address, calls=5, chunks=2, chunk_bytes=4096, warmup=1)
    finally:
        assert server.stop() == 0, server.log


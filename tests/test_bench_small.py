"""bench/_small_requests.py against a real kvtier-server and the bench's real TCP ceiling: both
systems are timed for GET and PUT, kvtier's requests really take its socket data path, and
the JSON keys bench/remote.py prints are there (the figures themselves belong to the bench)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.kvtier_servers import start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _small_requests import BLOCK, measure_small, small_summary  # noqa: E402
from remote import start_tcp  # noqa: E402


def test_small_requests_time_both_systems_and_name_the_keys(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--cpu-bytes", "32MiB", "--slot-bytes", "80KiB")
    tcp, ports = start_tcp(tmp_path)
    try:
        times = measure_small({"kvtier": server.address, "tcp": ports}, blocks=2,
                              pids={"kvtier": server.proc.pid, "tcp": tcp.pid})
        rounds = {f"{op} {system}" for op in ("get", "put") for system in ("kvtier", "tcp")}
        assert set(times) == rounds | {f"{r} cpu {side}" for r in rounds for side in ("client", "server")}
        assert all(len(v) == 2 and min(v) > 0 for v in times.values())
        out = small_summary(times)
        for op in ("get", "put"):
            k, t = out[f"small_{op}_us_kvtier"], out[f"small_{op}_us_tcp"]
            assert k["min"] <= k["median"] <= k["max"] and t["min"] <= t["median"] <= t["max"]
            assert out[f"small_{op}_kvtier_vs_tcp"] == k["median"] / t["median"]
            for system in ("kvtier", "tcp"):
                for side in ("client", "server"):
                    cpu = out[f"small_{op}_cpu_us_{system}_{side}"]
                    # a side's CPU per request is part of the round trip's wall time only
                    # when the other side runs meanwhile: bounded by the two cores' time
                    assert 0 < cpu["median"] <= 2 * out[f"small_{op}_us_{system}"]["max"]
        metrics = server.metrics()
        for method in ("data.Get", "data.Put"):  # the socket data path served them, not gRPC
            line = next(ln for ln in metrics.splitlines()
                        if f'method="{method}"' in ln and 'code="OK"' in ln and not ln.startswith("#"))
            assert float(line.rsplit(" ", 1)[1]) >= 2 * BLOCK
    finally:
        tcp.terminate()
        tcp.wait(10)
        assert server.stop() == 0, server.log

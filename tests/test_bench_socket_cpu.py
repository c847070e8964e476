"""bench/remote.py's CPU per GB of the headline socket figures, read against a real kvtier-server
and the real TCP ceiling it starts: each window yields the server's and the clients' CPU
seconds per GB moved, both positive and bounded by the window's own wall time, and the summary
keys name each (system, op, side)."""

from __future__ import annotations

import multiprocessing as mp
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _remote_clients import worker  # noqa: E402
from remote import measure, socket_cpu_summary, start_kvtier, start_tcp  # noqa: E402

MiB = 1 << 20
WINDOW_S = 0.4


def test_socket_figures_carry_each_sides_cpu_per_gb(tmp_path: Path) -> None:
    kv_proc, kv_addr = start_kvtier(tmp_path, slots=64)
    tcp_proc, tcp_port = start_tcp(tmp_path)
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(0, {"kvtier": kv_addr, "tcp": tcp_port}, theirs), daemon=True)
    proc.start()
    cpu: dict[str, list[tuple[float, float]]] = {}
    try:
        for system, path, pid in (("kvtier", "socket", kv_proc.pid), ("tcp", "-", tcp_proc.pid)):
            for op in ("put", "get"):
                name = f"{'kvtier-socket' if system == 'kvtier' else 'tcp'} {op} 1MiB x4"
                pairs = cpu.setdefault(name, [])
                gbps = measure([mine], 1, system, path, MiB, op, WINDOW_S, ((pid, [proc.pid]), pairs))
                assert gbps > 0
                (server_s, clients_s), = pairs
                moved_gb = gbps * WINDOW_S  # about: the window's own wall time
                # Each side ran at most the window (one client, one server thread at a time
                # for the ceiling; a few for kvtier) and did run: a socket moved the bytes.
                assert 0 < server_s * moved_gb < 4 * WINDOW_S, (name, server_s, moved_gb)
                assert 0 < clients_s * moved_gb < 2 * WINDOW_S, (name, clients_s, moved_gb)
    finally:
        mine.send(None)
        proc.join(20)
        kv_proc.terminate()
        tcp_proc.terminate()
        kv_proc.wait(20)
        tcp_proc.wait(20)
    summary = socket_cpu_summary(cpu, " 1MiB x4")
    assert set(summary) == {f"socket_{op}_cpu_s_per_gb_{s}_{side}" for op in ("get", "put")
                            for s in ("kvtier", "tcp") for side in ("server", "clients")}
    assert all(v is not None and v["min"] > 0 for v in summary.values())
    assert summary["socket_put_cpu_s_per_gb_kvtier_server"]["median"] == cpu["kvtier-socket put 1MiB x4"][0][0]

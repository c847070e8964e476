"""Round trip of one small request against a real kvtier-server and against the TCP ceiling
(bench/remote.py): the per-request cost that bytes do not hide.

A GET or PUT of 8 chunks of 4 KiB moves 32 KiB, which loopback carries in a few
microseconds, so its round trip is almost all fixed cost: framing, the store's bookkeeping,
the chunk checks, the client's tier layers, the system calls. Connectors pay it per restore
and per save, on top of the bytes. Both systems are driven as bench/_remote_clients.py drives
them (kvtier: ``GrpcTier`` on the socket data path, ``get_into`` preallocated buffers and
``put`` of whole chunks; the ceiling: one 9-byte request and the batch's bytes, no store, no
checks), one client on the caller's thread, in interleaved blocks so that load drift hits
both alike. Keys: ``small_{get,put}_us_kvtier`` and ``small_{get,put}_us_tcp``, each
{"min","median","max"} µs per request over blocks, and ``small_{get,put}_kvtier_vs_tcp``
(median round trip over the ceiling's: how many ceiling round trips one kvtier request costs).

Where the round trip goes: CPU time per request of each side, read over the same blocks
(the client: this process's ``time.process_time``; the server: the run time of its process's
threads, ``/proc/PID/task/*/schedstat``, in ns where ``/proc/PID/stat`` counts 10 ms ticks,
where the caller names the servers' pids):
``small_{get,put}_cpu_us_{kvtier,tcp}_{client,server}``, {"min","median","max"} µs. The wall
round trip is less than their sum where the two sides run at once on the two cores, more
where a side waits to be scheduled.
"""

from __future__ import annotations

import time
from typing import Any

from _remote_clients import _Client
from _stats import Stats, process_cpu_s

SIZE = 4096  # bytes of payload per chunk
KEYS = 8
BLOCK = 200  # requests per timed block


def measure_small(addr: dict[str, Any], blocks: int, pids: dict[str, int] | None = None) -> dict[str, list[float]]:
    """µs per request of each (system, op), one list entry per block: ``"get kvtier"`` the
    round trip; ``"get kvtier cpu client"`` / ``"... server"`` the CPU time of each side
    (the server's where ``pids`` names that system's server process)."""
    pids = pids or {}
    clients = {s: _Client(s, "socket" if s == "kvtier" else "-", addr, 900, SIZE, KEYS * SIZE)
               for s in ("kvtier", "tcp")}
    times: dict[str, list[float]] = {}
    try:
        for client in clients.values():
            client.put()  # the keys a get reads exist; connections are warm
        for _ in range(blocks):
            for system, client in clients.items():
                for op in ("get", "put"):
                    fn = client.put if op == "put" else lambda c=client: c.get(into=True)
                    pid = pids.get(system)
                    server0 = process_cpu_s(pid) if pid else 0.0
                    client0, start = time.process_time(), time.perf_counter()
                    for _ in range(BLOCK):
                        fn()
                    times.setdefault(f"{op} {system}", []).append((time.perf_counter() - start) / BLOCK * 1e6)
                    times.setdefault(f"{op} {system} cpu client", []).append(
                        (time.process_time() - client0) / BLOCK * 1e6)
                    if pid:
                        times.setdefault(f"{op} {system} cpu server", []).append(
                            (process_cpu_s(pid) - server0) / BLOCK * 1e6)
    finally:
        for client in clients.values():
            client.close()
    return times


def small_summary(times: dict[str, list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in ("get", "put"):
        k, t = Stats.of(times[f"{op} kvtier"]), Stats.of(times[f"{op} tcp"])
        out[f"small_{op}_us_kvtier"], out[f"small_{op}_us_tcp"] = vars(k), vars(t)
        out[f"small_{op}_kvtier_vs_tcp"] = k.median / t.median
        for system in ("kvtier", "tcp"):
            for side in ("client", "server"):
                if f"{op} {system} cpu {side}" in times:
                    out[f"small_{op}_cpu_us_{system}_{side}"] = vars(Stats.of(times[f"{op} {system} cpu {side}"]))
    return out

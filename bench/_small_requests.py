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
"""

from __future__ import annotations

import time
from typing import Any

from _remote_clients import _Client
from _stats import Stats

SIZE = 4096  # bytes of payload per chunk
KEYS = 8
BLOCK = 200  # requests per timed block


def measure_small(addr: dict[str, Any], blocks: int) -> dict[str, list[float]]:
    """µs per request of each (system, op), one list entry per block."""
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
                    start = time.perf_counter()
                    for _ in range(BLOCK):
                        fn()
                    times.setdefault(f"{op} {system}", []).append((time.perf_counter() - start) / BLOCK * 1e6)
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
    return out

#!/usr/bin/env python
"""kvtier-server vs Redis vs the loopback limit, in one run on this machine.

    python bench/remote.py [--quick] [--reps N] [--seconds S]

Starts a kvtier-server (1 node, RAM tier), its own redis-server (redis-py + hiredis,
pipelined MSET/MGET; also redis-py "tuned" as bench/remote_redis.py sets it up) and a plain
asyncio TCP source/sink (the loopback limit), then moves batches of 8 MiB of values (256 KiB or
1 MiB each) with 1 and 4 concurrent clients (separate processes), put, get (fresh ``bytes``,
like MGET) and get_into (caller's buffers), for every data path the grpc tier supports: shm
(what it picks for a node on this host), socket, grpc. Each figure is
aggregate GB/s over a timed window, repeated (min/median/max). Ratios use medians of the
same run. Last line: one JSON object (get_vs_redis, put_vs_redis, get_vs_tcp, put_vs_tcp at
1 MiB / 4 clients for the path the client picks by default, and every raw figure).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing as mp
import os
import socket
import struct
import subprocess
import sys
import tempfile
import time
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from _stats import Stats, fmt

BATCH_BYTES = 8 << 20
SIZES = {"256KiB": 256 << 10, "1MiB": 1 << 20}
CLIENTS = (1, 4)
_TCP = struct.Struct("<cQ")


# --- the loopback limit: an asyncio TCP source/sink ---------------------------------------------
class _SourceSink(asyncio.BufferedProtocol):
    """``P`` + n: read n bytes (into one reused buffer), answer one byte. ``G`` + n: write n bytes."""

    def __init__(self, payload: memoryview) -> None:
        self.payload = payload
        self.buf = bytearray(1 << 20)
        self.head = bytearray()
        self.sink_left = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buf)

    def buffer_updated(self, nbytes: int) -> None:
        data = memoryview(self.buf)[:nbytes]
        while data:
            if self.sink_left:
                take = min(self.sink_left, len(data))
                self.sink_left -= take
                data = data[take:]
                if not self.sink_left:
                    self.transport.write(b"k")
                continue
            need = _TCP.size - len(self.head)
            self.head += data[:need]
            data = data[need:]
            if len(self.head) == _TCP.size:
                op, n = _TCP.unpack(self.head)
                self.head = bytearray()
                if op == b"P":
                    self.sink_left = n
                else:
                    for off in range(0, n, len(self.payload)):
                        self.transport.write(self.payload[: min(len(self.payload), n - off)])


def tcp_server(port_file: str) -> None:
    payload = memoryview(os.urandom(BATCH_BYTES))

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: _SourceSink(payload), "127.0.0.1", 0)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        await asyncio.Event().wait()

    asyncio.run(main())


# --- client workers (one process each) ---------------------------------------------------------
def _key(*parts: object) -> bytes:
    return hashlib.sha256("/".join(map(str, parts)).encode()).digest()


class _Client:
    def __init__(self, system: str, path: str, addr: dict[str, Any], wid: int, size: int) -> None:
        import numpy as np

        from kvtier.chunk import encode_chunk

        n = BATCH_BYTES // size
        self.system, self.size = system, size
        self.keys = [_key(wid, size, i) for i in range(n)]
        rng = np.random.default_rng(wid)
        self.values = [bytes(encode_chunk(b"\0" * 32, k, "uint8", (1, 1, size, 1, 1),
                                          rng.integers(0, 255, size, dtype=np.uint8))) for k in self.keys]
        self.nbytes = sum(len(v) for v in self.values)
        if system == "kvtier":
            from kvtier.config import GrpcTierConfig
            from kvtier.tiers.base import Entry
            from kvtier.tiers.remote import GrpcTier

            self.tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(addr["kvtier"],), data_path=path,
                                                timeout_s=60))
            self.entries = [Entry(k, v) for k, v in zip(self.keys, self.values)]
            self.outs = [memoryview(bytearray(len(v))) for v in self.values]
        elif system == "redis":
            import redis

            if path == "tuned":  # redis-py with the Python packer and 1 MiB reads (bench/remote_redis.py)
                from remote_redis import tuned_single

                self.redis = tuned_single(addr["redis"])
            else:  # as shipped: hiredis, default settings
                self.redis = redis.Redis(host="127.0.0.1", port=addr["redis"], socket_timeout=60)
            self.mapping = dict(zip(self.keys, self.values))
        else:
            self.sock = socket.create_connection(("127.0.0.1", addr["tcp"]))
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.recv_buf = memoryview(bytearray(self.nbytes))

    def put(self) -> None:
        if self.system == "kvtier":
            assert all(self.tier.put(self.entries))
        elif self.system == "redis":
            self.redis.mset(self.mapping)
        else:
            self.sock.sendall(_TCP.pack(b"P", self.nbytes))
            for v in self.values:
                self.sock.sendall(v)
            assert self.sock.recv(1) == b"k"

    def get(self, into: bool = False) -> None:
        if self.system == "kvtier":
            got = self.tier.get_into(self.keys, self.outs) if into else self.tier.get(self.keys)
            assert all(not hasattr(g, "reason") for g in got), got
        elif self.system == "redis":
            assert all(v is not None for v in self.redis.mget(self.keys))
        else:
            self.sock.sendall(_TCP.pack(b"G", self.nbytes))
            view, got = self.recv_buf, 0
            while got < self.nbytes:
                got += self.sock.recv_into(view[got:])


def worker(wid: int, addr: dict[str, Any], conn: Connection) -> None:
    clients: dict[tuple[str, str, int], _Client] = {}
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        system, path, size, op, start, seconds = cmd
        client = clients.get((system, path, size))
        if client is None:
            client = clients[(system, path, size)] = _Client(system, path, addr, wid, size)
            client.put()  # the keys a get reads exist, and connections are warm
        if start is None:  # setup only
            conn.send(None)
            continue
        fn = client.put if op == "put" else partial(client.get, into=op == "get_into")
        time.sleep(max(0.0, start - time.monotonic()))
        moved, end = 0, start + seconds
        while time.monotonic() < end:
            fn()
            moved += client.nbytes
        conn.send((moved, time.monotonic() - start))


# --- orchestration ------------------------------------------------------------------------------
def start_kvtier(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    ready = work / "ready.json"
    slot = (1 << 20) + 4096  # a 1 MiB payload plus its 128-byte header
    cmd = [sys.executable, "-m", "kvtier.server.main", "--port", "0", "--http-port", "-1", "--data-port", "0",
           "--cpu-bytes", str(600 * slot), "--slot-bytes", str(slot), "--ready-file", str(ready),
           "--log-level", "WARNING"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if ready.exists():
            return proc, f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"
        if proc.poll() is not None:
            raise SystemExit("kvtier-server exited at start")
        time.sleep(0.05)
    raise SystemExit("kvtier-server not ready")


def start_tcp(work: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = work / "tcp.port"
    proc = subprocess.Popen([sys.executable, __file__, "--tcp-server", str(port_file)])
    for _ in range(200):
        if port_file.exists() and port_file.read_text():
            return proc, int(port_file.read_text())
        time.sleep(0.05)
    raise SystemExit("tcp source/sink not ready")


def measure(pipes: list[Connection], clients: int, system: str, path: str, size: int, op: str,
            seconds: float) -> float:
    """Aggregate GB/s of ``clients`` workers running ``op`` together for ``seconds``."""
    use = pipes[:clients]
    for p in use:
        p.send((system, path, size, op, None, seconds))
    for p in use:
        p.recv()
    start = time.monotonic() + 0.05
    for p in use:
        p.send((system, path, size, op, start, seconds))
    results = [p.recv() for p in use]
    return sum(m for m, _ in results) / max(e for _, e in results) / 1e9


def tuned_redis_available() -> bool:
    try:
        from remote_redis import tuned_single  # noqa: F401 - the redis helper's tuned client
    except ImportError:
        return False
    return True


def label(system: str, path: str, op: str, size_name: str, clients: int) -> str:
    return f"{system}{'-' + path if path != '-' else ''} {op} {size_name} x{clients}"


def run_plan(quick: bool, tuned: bool) -> dict[tuple[str, int], list[tuple[str, str, str]]]:
    """(size, clients) -> figures to take. The headline figures (kvtier on its default path,
    redis, tcp; put and get) at every size and client count; the rest (get_into, the gRPC
    path, redis with the tuned client) everywhere in a full run, at 1 MiB x 4 with --quick."""
    base = [(sy, p, op) for sy, p in (("kvtier", "shm"), ("kvtier", "socket"), ("redis", "-"), ("tcp", "-"))
            for op in ("put", "get")]
    extra = [("kvtier", "shm", "get_into"), ("kvtier", "socket", "get_into"), ("kvtier", "grpc", "put"),
             ("kvtier", "grpc", "get"), ("kvtier", "grpc", "get_into")]
    if tuned:
        extra += [("redis", "tuned", "put"), ("redis", "tuned", "get")]
    plan = {}
    for size_name in SIZES:
        for clients in CLIENTS:
            full = not quick or (size_name, clients) == ("1MiB", 4)
            plan[(size_name, clients)] = base + (extra if full else [])
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short windows (finishes in under a minute)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=None, help="measuring window per figure")
    ap.add_argument("--tcp-server", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tcp_server:
        tcp_server(args.tcp_server)
        return
    seconds = args.seconds or (0.15 if args.quick else 1.0)
    reps = max(3, args.reps)
    from redis_servers import RedisServer

    from kvtier.config import GrpcTierConfig
    from kvtier.tiers.remote import GrpcTier

    work = Path(tempfile.mkdtemp(prefix="kvtier-remote-bench-"))
    kv_proc, kv_addr = start_kvtier(work)
    tcp_proc, tcp_port = start_tcp(work)
    rs = RedisServer().start()
    ctx = mp.get_context("spawn")  # grpc does not survive fork
    pipes, procs = [], []
    try:
        probe = GrpcTier(GrpcTierConfig(enabled=True, nodes=(kv_addr,)))
        data = probe.nodes[0].data
        default_path = data.kind if data is not None else "grpc"
        probe.close()
        addr = {"kvtier": kv_addr, "redis": rs.port, "tcp": tcp_port}
        for wid in range(max(CLIENTS)):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(wid, addr, theirs), daemon=True)
            proc.start()
            pipes.append(mine)
            procs.append(proc)
        plan = run_plan(args.quick, tuned_redis_available())
        results: dict[str, list[float]] = {}
        print(f"kvtier-server {kv_addr} (client default data path: {default_path}), "
              f"redis {rs.port}, tcp {tcp_port}; {seconds}s windows x {reps} reps; batches of 8 MiB")
        for (size_name, clients), figures in plan.items():
            for _ in range(reps):  # reps interleaved: load drift hits every system alike
                for system, path, op in figures:
                    name = label(system, path, op, size_name, clients)
                    results.setdefault(name, []).append(
                        measure(pipes, clients, system, path, SIZES[size_name], op, seconds))
            for system, path, op in figures:
                name = label(system, path, op, size_name, clients)
                print(f"{name:36s} {fmt(results[name], 'GB/s')}", flush=True)
    finally:
        for p in pipes:
            p.send(None)
        for proc in procs:
            proc.join(10)
        kv_proc.terminate()
        kv_proc.wait(20)
        tcp_proc.terminate()
        rs.stop()
    med = {k: Stats.of(v).median for k, v in results.items()}
    kv = f"kvtier-{default_path}"

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    out: dict[str, Any] = {
        "get_vs_redis": ratio(f"{kv} get 1MiB x4", "redis get 1MiB x4"),
        "put_vs_redis": ratio(f"{kv} put 1MiB x4", "redis put 1MiB x4"),
        "get_vs_tcp": ratio(f"{kv} get 1MiB x4", "tcp get 1MiB x4"),
        "put_vs_tcp": ratio(f"{kv} put 1MiB x4", "tcp put 1MiB x4"),
        "get_into_vs_tcp": ratio(f"{kv} get_into 1MiB x4", "tcp get 1MiB x4"),
        "get_into_vs_redis": ratio(f"{kv} get_into 1MiB x4", "redis get 1MiB x4"),
        "socket_path_get_vs_redis": ratio("kvtier-socket get 1MiB x4", "redis get 1MiB x4"),
        "socket_path_put_vs_redis": ratio("kvtier-socket put 1MiB x4", "redis put 1MiB x4"),
        "socket_path_get_vs_tcp": ratio("kvtier-socket get 1MiB x4", "tcp get 1MiB x4"),
        "socket_path_put_vs_tcp": ratio("kvtier-socket put 1MiB x4", "tcp put 1MiB x4"),
        "get_vs_redis_tuned": ratio(f"{kv} get 1MiB x4", "redis-tuned get 1MiB x4"),
        "put_vs_redis_tuned": ratio(f"{kv} put 1MiB x4", "redis-tuned put 1MiB x4"),
        "grpc_path_get_vs_redis": ratio("kvtier-grpc get 1MiB x4", "redis get 1MiB x4"),
        "grpc_path_put_vs_redis": ratio("kvtier-grpc put 1MiB x4", "redis put 1MiB x4"),
        "default_data_path": default_path, "quick": args.quick, "reps": reps, "window_s": seconds,
        "gbps": {k: {"min": Stats.of(v).min, "median": Stats.of(v).median, "max": Stats.of(v).max}
                 for k, v in results.items()},
    }
    print("ratios (medians, 1 MiB x 4 clients): " + ", ".join(
        f"{k} {v:.2f}" for k, v in out.items() if k.endswith(("redis", "tcp", "tuned")) and v is not None))
    from remote_redis import run_redis_bench  # the redis tier vs raw redis-py (issue 3's keys)

    out.update(run_redis_bench(quick=args.quick))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

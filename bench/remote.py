#!/usr/bin/env python
"""kvtier-server against Redis and against this machine's own ceilings, in one run.

    python bench/remote.py [--quick] [--reps N] [--seconds S]

Starts a kvtier-server (1 node, RAM tier; a second one with 128 tenants for one figure), its
own redis-server (redis-py as shipped, with hiredis, and redis-py "tuned" with the non-copying
Python packer kvtier's redis tier uses, bench/remote_redis.py; pipelined MSET/MGET) and the
ceilings of bench/_loopback.py: a TCP source/sink built like kvtier's data plane (a blocking
thread per connection, ``sendmsg`` / ``recv_into``, no per-operation allocation: the best a
Python server does on this socket) and an inter-process memcpy through shared memory (the
least work that moves bytes between two processes' memory: for a put, the client's copy into
a segment and the server's out of it; for a get, since kvtier's GETs reference the server's
arena mapped read-only (kvtier.server.arena_refs), the client's one copy out of the server's
shared memory). It then moves batches of 8 MiB of
values (256 KiB or 1 MiB each) with 1 and 4 concurrent clients (separate processes,
bench/_remote_clients.py): put, get (fresh ``bytes``, like MGET) and get_into (caller's
buffers), for every data path the grpc tier supports: shm (what it picks for a node on this
host), socket, grpc. Each figure is aggregate GB/s over a timed window,
repeated with the systems interleaved (min/median/max); ratios use medians of the same run.

Last line: one JSON object. Headline ratios, like for like at 1 MiB x 4 clients:
``socket_{get,put}_vs_tcp`` and ``socket_{get,put}_vs_redis_tuned`` (kvtier's bytes over the
same loopback socket as the baseline's), ``shm_{get,put}_vs_memcpy`` (the shm path against
its own ceiling). The ceilings receive into a buffer made once, so ``socket_get_vs_tcp``
includes the fresh ``bytes`` kvtier's ``get`` allocates; ``socket_get_into_vs_tcp`` and
``shm_get_into_vs_memcpy`` compare buffer with buffer, of the same kind (kvtier's targets lie
back to back in one page-aligned numpy buffer, as the ceilings' batch does: transparent huge
pages where the kernel gives them). ``shm_*_vs_redis`` / ``shm_*_vs_tcp`` are what the old headline keys
``get_vs_redis`` ... measured (the client's default path on loopback is shm, whose bytes never
cross a socket): kept, named for what they compare; ``*_vs_tcp_asyncio`` and
``tcp_asyncio_*_vs_tcp`` keep the old single-threaded asyncio baseline in view;
``shm_get_vs_memcpy_two_copies`` keeps the get ceiling of before arena reads in view (the
server's copy into the segment, then the client's), and ``memcpy_two_copies_get_vs_memcpy``
says what the second copy costs.
The ceilings serve each connection its own memory, as a store serves each client its own
values (4 clients read 32 MiB of distinct bytes), and read with ``MSG_WAITALL`` as kvtier does;
``*_vs_tcp_hot`` and ``tcp_hot_*_vs_tcp`` keep the earlier ceiling in view, whose one shared
8 MiB source and 1 MiB sink window stay cache-hot (bench/_loopback.py).
``socket_put_128_tenants_vs_1``: the same socket PUT to a second kvtier-server with 128
tenants (tokens file; the clients use the first), against the one-tenant server: a
per-request cost that grows with the tenant count shows here (the RAM budget check once read
every tenant's usage on every PUT); 1.0 is the target. ``shm_put_evicting_vs_rewriting``: the
shm PUT of chunks new to a third kvtier-server (LRU, room for two batches per client; each
client puts four batches of distinct keys in turn), so every chunk evicts an older one, the
steady state of a full cache, against the shm PUT that rewrites the same keys (each reuses its
own slot) from as much client memory: four batches of values for the one batch of keys, put
in turn (``kvtier-rewriting``); 1.0 is the target. ``shm_put_evicting_vs_shm_put`` is what that
key compared before: the same evicting PUT against the headline shm PUT, whose clients put one
batch of values again and again, so they read a quarter of the memory (cache-warm where the
evicting clients' four batches are not).
``socket_{get,put}_vs_lmcache`` and ``shm_get_vs_lmcache`` compare with LMCache's ``lm://``
server driven by the same workers (pipelined GETs into preallocated buffers;
bench/peer_lmcache.py), skipped with a message when lmcache is not installed (not a CI
dependency). ``gbps`` holds every raw figure.

Lookup latency (bench/_lookup_latency.py), first, before any worker starts: single probes of
16 stored 1 MiB chunks, ``--lookup-calls`` each (2000; 500 with --quick), per path:
``lookup_us_grpc`` (the gRPC Lookup RPC), ``lookup_us_data_path`` (a LOOKUP frame on the data
port), ``lookup_us_client`` (``GrpcTier.probe`` as a connector calls it) and
``lookup_us_client_grpc`` (the same with ``data_path="grpc"``), each {"min","median","max"}
in µs; ``lookup_data_path_vs_grpc`` and ``lookup_client_vs_client_grpc`` are median ratios
(below 1: the data path is faster).

Small requests (bench/_small_requests.py), next, still before the workers: the round trip of
one GET and one PUT of 8 chunks of 4 KiB, kvtier's socket path against the TCP ceiling, one
client: ``small_{get,put}_us_kvtier``, ``small_{get,put}_us_tcp`` and
``small_{get,put}_kvtier_vs_tcp`` (the per-request cost bytes do not hide), and the CPU time
each side spends per request, ``small_{get,put}_cpu_us_{kvtier,tcp}_{client,server}``.

Where the headline socket figures' CPU goes: for kvtier's socket path and the TCP ceiling, put
and get, every window also reads the CPU time of the server process (its threads' run time,
``/proc/PID/task/*/schedstat``) and of the client processes, per GB moved:
``socket_{get,put}_cpu_s_per_gb_{kvtier,tcp}_{server,clients}`` at 1 MiB x 4,
{"min","median","max"} over the reps. Two cores run both sides, so a ratio below 1 is the sum
of these two, per GB, against the ceiling's: these keys say which side pays it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from _lookup_latency import PATHS, measure_lookups, summary
from _loopback import serve
from _remote_clients import BATCH_BYTES, TENANT_TOKEN, worker
from _small_requests import measure_small, small_summary
from _stats import Stats, fmt, process_cpu_s

SIZES = {"256KiB": 256 << 10, "1MiB": 1 << 20}
CLIENTS = (1, 4)
TENANTS = 128  # the many-tenant server's tenant count
# the CPU a socket figure is read with: ((server pid, worker pids), where its (server, clients)
# CPU-s per GB pairs go)
CpuOf = tuple[tuple[int, list[int]], list[tuple[float, float]]]


# --- orchestration ------------------------------------------------------------------------------
def start_kvtier(work: Path, tenants: int = 0, slots: int = 600, lru: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """A kvtier-server (RAM tier of ``slots`` 1 MiB chunks, ``lru``: with the LRU policy);
    ``tenants`` > 0: with a tokens file of that many tenants."""
    ready = work / f"ready-{tenants}-{slots}-{lru}.json"
    slot = (1 << 20) + 4096  # a 1 MiB payload plus its 128-byte header
    cmd = [sys.executable, "-m", "kvtier.server.main", "--port", "0", "--http-port", "-1", "--data-port", "0",
           "--cpu-bytes", str(slots * slot), "--slot-bytes", str(slot), "--ready-file", str(ready),
           "--log-level", "WARNING", *(("--set", "cpu.policy=lru") if lru else ())]
    if tenants:
        tokens = work / "tokens"
        tokens.write_text("".join(f"{TENANT_TOKEN.format(i)} tenant{i}\n" for i in range(tenants)))
        tokens.chmod(0o600)
        cmd += ["--tokens-file", str(tokens)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        if ready.exists():
            return proc, f"127.0.0.1:{json.loads(ready.read_text())['grpc_port']}"
        if proc.poll() is not None:
            raise SystemExit("kvtier-server exited at start")
        time.sleep(0.05)
    raise SystemExit("kvtier-server not ready")


def start_tcp(work: Path) -> tuple[subprocess.Popen[bytes], list[int]]:
    """The ceilings' process (bench/_loopback.py): [threaded port, old asyncio port]."""
    port_file = work / "tcp.port"
    proc = subprocess.Popen([sys.executable, __file__, "--tcp-server", str(port_file)])
    for _ in range(600):
        if port_file.exists():
            return proc, [int(p) for p in port_file.read_text().split()]
        time.sleep(0.05)
    raise SystemExit("tcp source/sink not ready")


def measure(pipes: list[Connection], clients: int, system: str, path: str, size: int, op: str,
            seconds: float, cpu_of: CpuOf | None = None) -> float:
    """Aggregate GB/s of ``clients`` workers running ``op`` together for ``seconds``. With
    ``cpu_of`` ((server pid, worker pids), a list to append to): the CPU seconds per GB moved
    of the server process and of the clients over the same window, appended as a pair."""
    use = pipes[:clients]
    for p in use:
        p.send((system, path, size, op, None, seconds))
    for p in use:
        p.recv()
    before = _cpu_now(cpu_of, clients) if cpu_of is not None else (0.0, 0.0)
    start = time.monotonic() + 0.05
    for p in use:
        p.send((system, path, size, op, start, seconds))
    results = [p.recv() for p in use]
    moved_gb = sum(m for m, _ in results) / 1e9
    if cpu_of is not None:
        after = _cpu_now(cpu_of, clients)
        cpu_of[1].append(((after[0] - before[0]) / moved_gb, (after[1] - before[1]) / moved_gb))
    return moved_gb / max(e for _, e in results)


def _cpu_now(cpu_of: CpuOf, clients: int) -> tuple[float, float]:
    """CPU seconds so far of the server process and of the first ``clients`` workers."""
    (server_pid, worker_pids), _ = cpu_of
    return process_cpu_s(server_pid), sum(map(process_cpu_s, worker_pids[:clients]))


def tuned_redis_available() -> bool:
    try:
        from remote_redis import tuned_single  # noqa: F401 - the redis helper's tuned client
    except ImportError:
        return False
    return True


def socket_cpu_summary(cpu: dict[str, list[tuple[float, float]]], at: str) -> dict[str, Any]:
    """``socket_{get,put}_cpu_s_per_gb_{kvtier,tcp}_{server,clients}``: CPU seconds per GB
    moved at 1 MiB x 4 clients, {"min","median","max"} over the reps (None where not run)."""
    out: dict[str, Any] = {}
    for op in ("get", "put"):
        for system, name in (("kvtier", f"kvtier-socket {op}{at}"), ("tcp", f"tcp {op}{at}")):
            for k, side in enumerate(("server", "clients")):
                got = [c[k] for c in cpu.get(name, [])]
                out[f"socket_{op}_cpu_s_per_gb_{system}_{side}"] = vars(Stats.of(got)) if got else None
    return out


def label(system: str, path: str, op: str, size_name: str, clients: int) -> str:
    return f"{system}{'-' + path if path != '-' else ''} {op} {size_name} x{clients}"


def run_plan(quick: bool, tuned: bool, lmcache: bool = False) -> dict[tuple[str, int], list[tuple[str, str, str]]]:
    """(size, clients) -> figures to take. The headline figures (kvtier's socket path against
    the TCP ceiling and tuned redis-py, kvtier's shm path against the memcpy ceiling; put and
    get) at every size and client count; the rest (get_into, the gRPC path, redis-py as
    shipped) everywhere in a full run, at 1 MiB x 4 with --quick."""
    base = [(sy, p, op) for sy, p in (("kvtier", "shm"), ("kvtier", "socket"), ("tcp", "-"), ("memcpy", "-"))
            for op in ("put", "get")]
    base += [("redis", "tuned", op) for op in ("put", "get")] if tuned else []
    extra = [("kvtier", "shm", "get_into"), ("kvtier", "socket", "get_into"), ("kvtier", "grpc", "put"),
             ("kvtier", "grpc", "get"), ("kvtier", "grpc", "get_into"), ("redis", "-", "put"),
             ("redis", "-", "get"), ("tcp", "asyncio", "put"), ("tcp", "asyncio", "get"),
             ("tcp", "hot", "put"), ("tcp", "hot", "get"), ("kvtier", "tenants", "put"), ("kvtier", "evicting", "put"),
             ("kvtier", "rewriting", "put"),
             ("memcpy", "two", "get")]
    extra += [("lmcache", "-", "put"), ("lmcache", "-", "get")] if lmcache else []
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
    ap.add_argument("--no-redis-tier", action="store_true",
                    help="skip bench/remote_redis.py's figures (the redis tier vs raw redis-py)")
    ap.add_argument("--lookup-calls", type=int, default=None,
                    help="probes timed per lookup path (default 2000, 500 with --quick)")
    ap.add_argument("--tcp-server", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tcp_server:
        serve(args.tcp_server)
        return
    seconds = args.seconds or (0.15 if args.quick else 1.0)
    reps = max(3, args.reps)
    from redis_servers import RedisServer

    from kvtier.config import GrpcTierConfig
    from kvtier.tiers.remote import GrpcTier

    work = Path(tempfile.mkdtemp(prefix="kvtier-remote-bench-"))
    kv_proc, kv_addr = start_kvtier(work)
    many_proc, many_addr = start_kvtier(work, TENANTS)
    # Two batches per client: each "evicting" put (ROTATION batches in turn) evicts older chunks.
    evict_proc, evict_addr = start_kvtier(work, slots=2 * max(CLIENTS) * BATCH_BYTES // (1 << 20), lru=True)
    tcp_proc, tcp_port = start_tcp(work)
    rs = RedisServer().start()
    from peer_lmcache import lmcache_python, start_server

    lm_python = lmcache_python()
    lm_proc = None
    if lm_python is None:
        print("lmcache not installed (see bench/peer_lmcache.py): the *_vs_lmcache figures are skipped")
    ctx = mp.get_context("spawn")  # grpc does not survive fork
    pipes, procs = [], []
    try:
        probe = GrpcTier(GrpcTierConfig(enabled=True, nodes=(kv_addr,)))
        data = probe.nodes[0].data
        default_path = data.kind if data is not None else "grpc"
        probe.close()
        lookup_calls = args.lookup_calls or (500 if args.quick else 2000)
        lookups = measure_lookups(kv_addr, lookup_calls)
        for path in PATHS:
            print(f"lookup 16 keys {path:27s} {fmt(lookups[path], 'us', 0)}", flush=True)
        addr = {"kvtier": kv_addr, "kvtier_tenants": many_addr, "kvtier_evicting": evict_addr, "redis": rs.port,
                "tcp": tcp_port}
        small = measure_small(addr, 5 if args.quick else 15, {"kvtier": kv_proc.pid, "tcp": tcp_proc.pid})
        for name, us in small.items():
            print(f"small {name:37s} {fmt(us, 'us', 0)} per 8 x 4 KiB request{' (CPU)' if ' cpu ' in name else ''}",
                  flush=True)
        if lm_python is not None:
            lm_proc, addr["lmcache"] = start_server(lm_python)
        for wid in range(max(CLIENTS)):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(wid, addr, theirs), daemon=True)
            proc.start()
            pipes.append(mine)
            procs.append(proc)
        plan = run_plan(args.quick, tuned_redis_available(), lm_proc is not None)
        results: dict[str, list[float]] = {}
        cpu: dict[str, list[tuple[float, float]]] = {}  # the headline socket figures' CPU per GB
        server_pids = {"kvtier": kv_proc.pid, "tcp": tcp_proc.pid}
        worker_pids = [proc.pid for proc in procs]
        print(f"kvtier-server {kv_addr} (client default data path: {default_path}), "
              f"redis {rs.port}, tcp/asyncio {tcp_port}; {seconds}s windows x {reps} reps; batches of 8 MiB")
        for (size_name, clients), figures in plan.items():
            for _ in range(reps):  # reps interleaved: load drift hits every system alike
                for system, path, op in figures:
                    name = label(system, path, op, size_name, clients)
                    cpu_of: CpuOf | None = None
                    if (system, path) in (("kvtier", "socket"), ("tcp", "-")) and op in ("put", "get"):
                        cpu_of = ((server_pids[system], worker_pids), cpu.setdefault(name, []))
                    results.setdefault(name, []).append(
                        measure(pipes, clients, system, path, SIZES[size_name], op, seconds, cpu_of))
            for system, path, op in figures:
                name = label(system, path, op, size_name, clients)
                print(f"{name:36s} {fmt(results[name], 'GB/s')}", flush=True)
                if name in cpu:
                    for side, k in (("server", 0), ("clients", 1)):
                        print(f"{'':6s}{side:7s} CPU per GB moved {fmt([c[k] for c in cpu[name]], 's', 3)}", flush=True)
    finally:
        for p in pipes:
            p.send(None)
        for proc in procs:
            proc.join(10)
        for server in (kv_proc, many_proc, evict_proc):
            server.terminate()
            server.wait(20)
        tcp_proc.terminate()
        if lm_proc is not None:
            lm_proc.terminate()
        rs.stop()
    med = {k: Stats.of(v).median for k, v in results.items()}

    def ratio(a: str, b: str) -> float | None:
        return med[a] / med[b] if a in med and b in med else None

    at = " 1MiB x4"
    pairs = {  # key -> (numerator, denominator), all at 1 MiB x 4 clients
        # headline, like for like: bytes over the socket against the best Python socket server
        # and against redis-py with kvtier's non-copying packer; shm against an inter-process memcpy
        "socket_get_vs_tcp": ("kvtier-socket get", "tcp get"),
        "socket_put_vs_tcp": ("kvtier-socket put", "tcp put"),
        "socket_get_vs_redis_tuned": ("kvtier-socket get", "redis-tuned get"),
        "socket_put_vs_redis_tuned": ("kvtier-socket put", "redis-tuned put"),
        "shm_get_vs_memcpy": ("kvtier-shm get", "memcpy get"),
        "shm_put_vs_memcpy": ("kvtier-shm put", "memcpy put"),
        # the rest, each named by the path it measures
        "socket_get_into_vs_tcp": ("kvtier-socket get_into", "tcp get"),
        "shm_get_into_vs_memcpy": ("kvtier-shm get_into", "memcpy get"),
        # against the two-copy get (the server's copy into the segment, then the client's):
        # the ceiling shm_get_vs_memcpy had before arena reads made kvtier's get one copy
        "shm_get_vs_memcpy_two_copies": ("kvtier-shm get", "memcpy-two get"),
        "memcpy_two_copies_get_vs_memcpy": ("memcpy-two get", "memcpy get"),
        "socket_get_vs_redis": ("kvtier-socket get", "redis get"),
        "socket_put_vs_redis": ("kvtier-socket put", "redis put"),
        # what the old headline keys (get_vs_redis, ...) measured: the shm path, whose bytes
        # never cross a socket, against systems whose bytes do
        "shm_get_vs_redis": ("kvtier-shm get", "redis get"),
        "shm_put_vs_redis": ("kvtier-shm put", "redis put"),
        "shm_get_vs_tcp": ("kvtier-shm get", "tcp get"),
        "shm_put_vs_tcp": ("kvtier-shm put", "tcp put"),
        # the old baseline (single-threaded asyncio) against the new one, and the old headline
        # get_vs_tcp / put_vs_tcp exactly as they were computed
        "tcp_asyncio_get_vs_tcp": ("tcp-asyncio get", "tcp get"),
        "tcp_asyncio_put_vs_tcp": ("tcp-asyncio put", "tcp put"),
        "shm_get_vs_tcp_asyncio": ("kvtier-shm get", "tcp-asyncio get"),
        "shm_put_vs_tcp_asyncio": ("kvtier-shm put", "tcp-asyncio put"),
        "socket_get_vs_tcp_asyncio": ("kvtier-socket get", "tcp-asyncio get"),
        "socket_put_vs_tcp_asyncio": ("kvtier-socket put", "tcp-asyncio put"),
        # against the ceiling as it was before it served each connection distinct memory:
        # one cache-hot source and sink window for all (bench/_loopback.py ``H``/``Q``)
        "socket_get_vs_tcp_hot": ("kvtier-socket get", "tcp-hot get"),
        "socket_put_vs_tcp_hot": ("kvtier-socket put", "tcp-hot put"),
        "tcp_hot_get_vs_tcp": ("tcp-hot get", "tcp get"),
        "tcp_hot_put_vs_tcp": ("tcp-hot put", "tcp put"),
        "grpc_get_vs_redis_tuned": ("kvtier-grpc get", "redis-tuned get"),
        "grpc_put_vs_redis_tuned": ("kvtier-grpc put", "redis-tuned put"),
        "redis_tuned_get_vs_tcp": ("redis-tuned get", "tcp get"),
        "redis_tuned_put_vs_tcp": ("redis-tuned put", "tcp put"),
        # a bare peer server (LMCache's lm://: a dict, no eviction, auth or checksums), both
        # sides receiving into preallocated buffers (None when lmcache is not installed)
        "socket_get_vs_lmcache": ("kvtier-socket get_into", "lmcache get"),
        "socket_put_vs_lmcache": ("kvtier-socket put", "lmcache put"),
        "shm_get_vs_lmcache": ("kvtier-shm get_into", "lmcache get"),
        # the same socket PUT to a server with TENANTS tenants against the one-tenant server
        f"socket_put_{TENANTS}_tenants_vs_1": ("kvtier-tenants put", "kvtier-socket put"),
        # the shm PUT of new chunks into a full server (each evicts an older one) against the
        # shm PUT rewriting the same keys (each takes its own old slot back), both clients
        # putting ROTATION batches of values in turn (the same client memory on both sides)
        "shm_put_evicting_vs_rewriting": ("kvtier-evicting put", "kvtier-rewriting put"),
        # the same against the headline shm PUT, whose clients put one batch of values again
        # and again (4x less client memory to read: what shm_put_evicting_vs_rewriting was)
        "shm_put_evicting_vs_shm_put": ("kvtier-evicting put", "kvtier-shm put"),
    }
    out: dict[str, Any] = {key: ratio(a + at, b + at) for key, (a, b) in pairs.items()}
    out.update({
        "default_data_path": default_path, "quick": args.quick, "reps": reps, "window_s": seconds,
        **summary(lookups),
        **small_summary(small),
        **socket_cpu_summary(cpu, at),
        "gbps": {k: vars(Stats.of(v)) for k, v in results.items()},
    })
    print("ratios (medians, 1 MiB x 4 clients): " + ", ".join(
        f"{k} {v:.2f}" for k, v in out.items() if k in pairs and v is not None))
    if not args.no_redis_tier:
        from remote_redis import run_redis_bench  # the redis tier vs raw redis-py

        out.update(run_redis_bench(quick=args.quick))
    print(json.dumps(out))


if __name__ == "__main__":
    main()

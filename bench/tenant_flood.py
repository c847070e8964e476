"""How much one tenant's gRPC bulk traffic slows another tenant's gRPC calls on one node.

A real kvtier-server with two tenants. Tenant "flood" stores ``--chunks`` chunks of
``--chunk-bytes`` and then streams them back with ``--streams`` concurrent gRPC ``Get`` calls
(``--flood put``: stores them again with as many ``Put`` streams), from a separate process (its client must not share a GIL with the measuring one). Tenant
"quiet" times, one call at a time, a ``Lookup`` of 4 small keys and a ``Get`` of one small
chunk: first with the node idle, then during the flood. Repeated ``--repeats`` times, the
order of nothing else changing; every call is checked (4 hits, the right bytes).

Ratios (medians of each repeat's p50 / p95, same client, same calls, same node):
``lookup_p50_flood_vs_idle``, ``lookup_p95_flood_vs_idle``, ``get_p50_flood_vs_idle``; and the
flood's own throughput ``flood_get_gbps`` / ``flood_put_gbps`` (the fairness must not be bought
with it). The data
path (a connection per engine thread) is not involved: engines that reach a data port never use
gRPC for these calls; this measures what gRPC-only clients see (docs/server.md "What tenants
share").

    python bench/tenant_flood.py [--flood get|put] [--streams 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

import grpc  # noqa: E402
from _stats import fmt  # noqa: E402
from kvtier_servers import make_chunk, make_keys, start_server  # noqa: E402

from kvtier.protocol.gen import kvtier_pb2 as pb  # noqa: E402
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc  # noqa: E402

FLOOD, QUIET = "flood-token-0123456789abcdef", "quiet-token-0123456789abcdef"
OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _flood(address: str, keys: list[bytes], chunk_bytes: int, op: str, streams: int, conn: Connection) -> None:
    """Stream ``keys`` back (``op`` "get") or store them again ("put", one chunk per message)
    on ``streams`` threads until told to stop; report bytes/s."""
    stop, got, lock = threading.Event(), [0], threading.Lock()
    chunks = [make_chunk(key, chunk_bytes) for key in keys] if op == "put" else []

    def one() -> None:
        with grpc.insecure_channel(address, options=OPTIONS) as channel:
            stub = pb_grpc.KVTierStub(channel)
            while not stop.is_set():
                if op == "get":
                    n = sum(len(i.chunk) for r in stub.Get(pb.GetRequest(keys=keys), metadata=_md(FLOOD),
                                                           timeout=120) for i in r.items)
                else:
                    requests = (pb.PutRequest(items=[pb.PutItem(key=k, chunk=c)]) for k, c in zip(keys, chunks))
                    stub.Put(requests, metadata=_md(FLOOD), timeout=120)
                    n = sum(len(c) for c in chunks)
                with lock:
                    got[0] += n
    threads = [threading.Thread(target=one, daemon=True) for _ in range(streams)]
    for t in threads:
        t.start()
    conn.recv()  # "start counting"
    start, before = time.perf_counter(), got[0]
    conn.recv()  # "stop"
    conn.send((got[0] - before) / (time.perf_counter() - start))
    stop.set()
    for t in threads:
        t.join(130)


def _quiet_calls(stub: pb_grpc.KVTierStub, keys: list[bytes], chunk: bytes, n: int) -> tuple[list[float], list[float]]:
    lookups, gets = [], []
    for _ in range(n):
        t = time.perf_counter()
        reply = stub.Lookup(pb.LookupRequest(keys=keys), metadata=_md(QUIET), timeout=60)
        lookups.append((time.perf_counter() - t) * 1e3)
        if reply.hits != len(keys):
            raise AssertionError(f"quiet tenant's Lookup found {reply.hits} of {len(keys)}")
        t = time.perf_counter()
        items = [i for r in stub.Get(pb.GetRequest(keys=keys[:1]), metadata=_md(QUIET), timeout=60) for i in r.items]
        gets.append((time.perf_counter() - t) * 1e3)
        if [i.chunk for i in items] != [chunk]:
            raise AssertionError("quiet tenant's Get returned other bytes")
        time.sleep(0.005)
    return lookups, gets


def _p(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(len(values) * q))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16, help="the flooding tenant's concurrent streams")
    ap.add_argument("--flood", choices=("get", "put"), default="get", help="what the flooding streams do")
    ap.add_argument("--chunks", type=int, default=32, help="chunks per flooding Get")
    ap.add_argument("--chunk-bytes", type=int, default=900_000, help="payload bytes per flooding chunk")
    ap.add_argument("--calls", type=int, default=60, help="quiet tenant's calls per phase")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvtier-flood-"))
    tokens = work / "tokens"
    tokens.write_text(f"{FLOOD} flood\n{QUIET} quiet\n")
    tokens.chmod(0o600)
    need = args.chunks * (args.chunk_bytes + (64 << 10)) * 2 + (64 << 20)
    node = start_server(work, "--tokens-file", str(tokens), "--cpu-bytes", str(need), "--slot-bytes", "1MiB")
    ratios: dict[str, list[float]] = {"lookup_p50": [], "lookup_p95": [], "get_p50": []}
    gbps: list[float] = []
    try:
        flood_keys, quiet_keys = make_keys(args.chunks, seed=1), make_keys(4, seed=2)
        quiet_chunk = make_chunk(quiet_keys[0], 4096)
        with grpc.insecure_channel(node.address, options=OPTIONS) as channel:
            stub = pb_grpc.KVTierStub(channel)
            for key in flood_keys:
                item = pb.PutItem(key=key, chunk=make_chunk(key, args.chunk_bytes))
                stub.Put(iter([pb.PutRequest(items=[item])]), metadata=_md(FLOOD), timeout=60)
            for key in quiet_keys:
                item = pb.PutItem(key=key, chunk=make_chunk(key, 4096))
                stub.Put(iter([pb.PutRequest(items=[item])]), metadata=_md(QUIET), timeout=60)
            for rep in range(args.repeats):
                idle = _quiet_calls(stub, quiet_keys, quiet_chunk, args.calls)
                parent, child = mp.get_context("spawn").Pipe()
                proc = mp.get_context("spawn").Process(
                    target=_flood, args=(node.address, flood_keys, args.chunk_bytes, args.flood, args.streams, child))
                proc.start()
                time.sleep(2.0)  # every stream running
                parent.send("start")
                busy = _quiet_calls(stub, quiet_keys, quiet_chunk, args.calls)
                parent.send("stop")
                gbps.append(parent.recv() / 1e9)
                proc.join(150)
                for name, (a, b) in {"lookup_p50": (idle[0], busy[0]), "lookup_p95": (idle[0], busy[0]),
                                     "get_p50": (idle[1], busy[1])}.items():
                    q = 0.95 if name.endswith("95") else 0.5
                    ratios[name].append(_p(b, q) / _p(a, q))
                print(f"repeat {rep}: lookup idle p50 {_p(idle[0], .5):.2f} p95 {_p(idle[0], .95):.2f} ms, "
                      f"flood p50 {_p(busy[0], .5):.2f} p95 {_p(busy[0], .95):.2f} ms; get idle p50 "
                      f"{_p(idle[1], .5):.2f}, flood p50 {_p(busy[1], .5):.2f} ms; flood {gbps[-1]:.3f} GB/s",
                      flush=True)
    finally:
        node.stop()
    for name, values in ratios.items():
        print(f"{name}_flood_vs_idle: {fmt(values)}")
    print(f"flood_{args.flood}_gbps: {fmt(gbps, 'GB/s', 3)}")
    out = {f"{name}_flood_vs_idle": round(statistics.median(v), 2) for name, v in ratios.items()}
    out[f"flood_{args.flood}_gbps"] = round(statistics.median(gbps), 3)
    out["streams"] = args.streams
    out["flood"] = args.flood
    print(json.dumps(out))


if __name__ == "__main__":
    main()

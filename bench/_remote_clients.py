"""bench/remote.py's client workers, one process each: each drives one system (kvtier over a
data path, redis-py as shipped or tuned, LMCache's server, the TCP and memcpy ceilings) with the
same batches of 8 MiB of values, on the orchestrator's commands over a pipe. Values are real
kvtier chunks (random payload), so every system moves the same bytes and kvtier's server can
verify them."""

from __future__ import annotations

import hashlib
import time
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from _loopback import LoopbackClient

BATCH_BYTES = 8 << 20
ROTATION = 4  # batches an "evicting" (or "rewriting") client puts in turn (bench/remote.py's server holds 2 per client)
TENANT_TOKEN = "bench-token-{:06d}"  # the many-tenant server's tokens (bench/remote.py)


def _receive_buffers(values: list[bytes]) -> list[memoryview]:
    """get_into's targets, one per value, back to back in one page-aligned buffer: the same
    kind of memory the ceilings receive a batch into (bench/_loopback.py), which numpy backs
    with transparent huge pages where the kernel allows (separate ``bytearray``s are 4 KiB
    pages: the kernel's copy into them cost ~10 % more here)."""
    from kvtier.chunk import page_aligned_buffer

    whole = page_aligned_buffer(sum(map(len, values)))
    out, at = [], 0
    for v in values:
        out.append(whole[at : at + len(v)])
        at += len(v)
    return out


def _key(*parts: object) -> bytes:
    return hashlib.sha256("/".join(map(str, parts)).encode()).digest()


class _Client:
    def __init__(self, system: str, path: str, addr: dict[str, Any], wid: int, size: int,
                 batch_bytes: int = BATCH_BYTES) -> None:
        import numpy as np

        from kvtier.chunk import encode_chunk

        n = batch_bytes // size
        self.system, self.path, self.size = system, path, size
        self.keys = [_key(wid, size, i) for i in range(n)]
        rng = np.random.default_rng(wid)
        payloads = [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]

        def chunk(key: bytes, payload: Any) -> bytes:
            return bytes(encode_chunk(b"\0" * 32, key, "uint8", (1, 1, size, 1, 1), payload))

        self.values = [chunk(k, p) for k, p in zip(self.keys, payloads)]
        self.nbytes = sum(len(v) for v in self.values)
        if system == "kvtier":
            from kvtier.config import GrpcTierConfig
            from kvtier.tiers.base import Entry
            from kvtier.tiers.remote import GrpcTier

            # "tenants": the many-tenant server, as tenant 0; "evicting": the full server;
            # "rewriting": the first server over shm, as "evicting" but rewriting its own keys
            node, data_path = {"tenants": ("kvtier_tenants", "socket"),
                               "evicting": ("kvtier_evicting", "shm"),
                               "rewriting": ("kvtier", "shm")}.get(path, ("kvtier", path))
            self.tier = GrpcTier(GrpcTierConfig(
                enabled=True, nodes=(addr[node],), data_path=data_path, timeout_s=60,
                token=TENANT_TOKEN.format(0) if path == "tenants" else ""))
            # put() sends these in turn: "evicting" has ROTATION batches of distinct keys, more
            # than its server holds, so every chunk put is new there and evicts an older one
            self.batches = [[Entry(k, v) for k, v in zip(self.keys, self.values)]]
            if path == "evicting":
                self.batches = [[Entry(k, chunk(k, p)) for k, p in
                                 zip((_key(wid, size, r, i) for i in range(n)), payloads)] for r in range(ROTATION)]
            elif path == "rewriting":  # the same keys each time, from as much client memory as "evicting"
                self.batches = [[Entry(k, chunk(k, p)) for k, p in zip(self.keys, payloads)] for _ in range(ROTATION)]
            self.turn = 0
            self.outs = _receive_buffers(self.values)
        elif system == "redis":
            import redis

            if path == "tuned":  # redis-py with the Python packer and 1 MiB reads (bench/remote_redis.py)
                from remote_redis import tuned_single

                self.redis = tuned_single(addr["redis"])
            else:  # as shipped: hiredis, default settings
                self.redis = redis.Redis(host="127.0.0.1", port=addr["redis"], socket_timeout=60)
            self.mapping = dict(zip(self.keys, self.values))
        elif system == "lmcache":  # LMCache's lm:// server (bench/peer_lmcache.py)
            from peer_lmcache import LMCacheClient

            self.lm = LMCacheClient(addr["lmcache"])
            self.lm_ids = [int.from_bytes(k[:8], "little") for k in self.keys]
            self.outs = _receive_buffers(self.values)
        else:  # "tcp" (the socket ceiling) or "memcpy" (the shared-memory ceiling)
            port = addr["tcp"][1 if path == "asyncio" else 0]
            self.loop = LoopbackClient(port, self.values, hot=path == "hot")

    def close(self) -> None:
        if self.system == "kvtier":
            self.tier.close()
        elif self.system in ("tcp", "memcpy"):
            self.loop.sock.close()

    def put(self) -> None:
        if self.system == "kvtier":
            self.turn = (self.turn + 1) % len(self.batches)
            assert all(self.tier.put(self.batches[self.turn]))
        elif self.system == "redis":
            self.redis.mset(self.mapping)
        elif self.system == "lmcache":
            for i, v in zip(self.lm_ids, self.values):
                self.lm.put(i, memoryview(v))
        elif self.system == "tcp":
            self.loop.tcp_put()
        else:
            self.loop.memcpy_put()

    def get(self, into: bool = False) -> None:
        if self.system == "kvtier":
            got = self.tier.get_into(self.keys, self.outs) if into else self.tier.get(self.keys)
            assert all(not hasattr(g, "reason") for g in got), got
        elif self.system == "redis":
            assert all(v is not None for v in self.redis.mget(self.keys))
        elif self.system == "lmcache":  # into preallocated buffers either way, pipelined
            assert self.lm.get_many_into(self.lm_ids, self.outs) == len(self.lm_ids)
        elif self.system == "tcp":
            self.loop.tcp_get()
        else:  # path "two": the two-copy get through a segment (kvtier's before arena reads)
            self.loop.memcpy_get(2 if self.path == "two" else 1)


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

"""One client process of tests/test_chaos.py: mixed load on a GrpcTier (3 kvtier-servers,
replication 2) and a RedisTier until a wall-clock end, every served chunk checked against the
oracle (a chunk is a pure function of its key), every call timed.

Usage: python -m tests._chaos_client CONFIG.json OUT.json. Writes one JSON document: counts,
wrong bytes, exceptions (type and message, first few), max latency per tier, and per-second
GrpcTier GET hit counts (wall-clock seconds) for the test's hit-ratio windows.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from collections import Counter
from typing import Any

from kvtier.config import GrpcTierConfig, RedisTierConfig
from kvtier.tiers.base import Entry, Miss, Tier
from kvtier.tiers.redis import RedisTier
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import make_chunk, make_keys

CHUNK = 16_000


def expected(key: bytes) -> bytes:
    return make_chunk(key, CHUNK, seed=key[0])


def main(cfg: dict[str, Any], out_path: str) -> None:
    rng = random.Random(cfg["seed"])
    keys = make_keys(cfg["keys"], seed=7)  # both processes share the key space
    oracle = {k: expected(k) for k in keys}
    grpc = GrpcTier(GrpcTierConfig(enabled=True, nodes=tuple(cfg["nodes"]), replication=2,
                                   timeout_s=cfg["timeout_s"], backoff_s=0.1, backoff_max_s=1.0))
    red = RedisTier(RedisTierConfig(enabled=True, url=cfg["redis"], timeout_s=cfg["timeout_s"],
                                    backoff_s=0.1, backoff_max_s=1.0))
    tiers: dict[str, Tier] = {"grpc": grpc, "redis": red}
    ops: Counter[str] = Counter()
    wrong = 0
    errors: list[str] = []
    max_latency = {"grpc": 0.0, "redis": 0.0}
    hits: dict[int, list[int]] = {}  # wall second -> [grpc get hits, grpc gets]

    def call(name: str, fn: Any, *args: Any) -> Any:
        nonlocal errors
        start = time.monotonic()
        try:
            return fn(*args)
        except Exception:  # noqa: BLE001 - the invariant under test: none may reach a caller
            errors.append(traceback.format_exc(limit=3))
            return None
        finally:
            max_latency[name] = max(max_latency[name], time.monotonic() - start)

    for i in range(0, len(keys), 16):  # warm-up: everything stored once
        batch = keys[i : i + 16]
        for name, tier in tiers.items():
            call(name, tier.put, [Entry(k, oracle[k]) for k in batch])
    end = cfg["end"]
    while time.time() < end:
        name = "grpc" if rng.random() < 0.75 else "redis"
        tier = tiers[name]
        batch = rng.sample(keys, rng.randint(1, 8))
        if rng.random() < 0.25:
            call(name, tier.put, [Entry(k, oracle[k]) for k in batch])
            ops[f"{name}.put"] += 1
            continue
        got = call(name, tier.get, batch)
        ops[f"{name}.get"] += 1
        if got is None:
            continue
        n_hit = 0
        for k, v in zip(batch, got):
            if isinstance(v, Miss):
                continue
            n_hit += 1
            if bytes(v) != oracle[k]:
                wrong += sum(a != b for a, b in zip(bytes(v), oracle[k])) + abs(len(v) - len(oracle[k]))
        if name == "grpc":
            slot = hits.setdefault(int(time.time()), [0, 0])
            slot[0] += n_hit
            slot[1] += len(batch)
    grpc.close()
    red.close()
    with open(out_path, "w") as f:
        json.dump({"ops": dict(ops), "wrong_bytes": wrong, "exceptions": len(errors), "errors": errors[:5],
                   "max_latency_s": max_latency, "hits": {str(k): v for k, v in hits.items()}}, f)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        main(json.load(f), sys.argv[2])

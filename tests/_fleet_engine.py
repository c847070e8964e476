"""An engine process for the fleet tests: a kvtier client whose only tier is its node-local
kvtier-server, reached over the shared-memory data path.

    python tests/_fleet_engine.py NODE OP FIRST COUNT [--wait-s S] [--token T]

OP ``save`` stores prefixes FIRST..FIRST+COUNT-1; ``load`` restores them and checks every
payload byte against what ``save`` wrote (prefix p's tokens and K/V come from seed p, so two
processes agree without sharing anything); ``wait`` polls lookups until every prefix is a
full hit (or ``--wait-s`` passes). Prints one JSON line. Any exception ends the process with
a traceback and a non-zero status: the tests count that as an error, so nothing is caught.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvtier.cache import PrefixCache
from kvtier.config import CpuTierConfig, GrpcTierConfig, KVTierConfig
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.tiers.remote import GrpcTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB chunks
CHUNKS = 4
TOKENS = LAYOUT.chunk_tokens * CHUNKS
SPEC = NamespaceSpec("fleet-test-model", LAYOUT, kv_dtype="float16")


def prefix(p: int) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and K/V (layers, 2, tokens, heads, head_dim) of prefix ``p``."""
    rng = np.random.default_rng(1000 + p)
    tokens = rng.integers(0, 32000, TOKENS, dtype=np.uint32)
    kv = rng.standard_normal((LAYOUT.num_layers, 2, TOKENS, LAYOUT.num_kv_heads, LAYOUT.head_dim))
    return tokens, kv.astype(np.float16)


def open_cache(node: str, token: str) -> PrefixCache:
    cfg = KVTierConfig(chunk_tokens=LAYOUT.chunk_tokens, cpu=CpuTierConfig(enabled=False),
                       grpc=GrpcTierConfig(enabled=True, nodes=(node,), data_path="shm",
                                           timeout_s=5.0, token=token))
    return PrefixCache.open(cfg, SPEC)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("node")
    ap.add_argument("op", choices=("save", "load", "wait"))
    ap.add_argument("first", type=int)
    ap.add_argument("count", type=int)
    ap.add_argument("--wait-s", type=float, default=20.0)
    ap.add_argument("--token", default="")
    args = ap.parse_args()
    cache = open_cache(args.node, args.token)
    tier = cache.store.tiers[0]
    assert isinstance(tier, GrpcTier)
    data = tier.nodes[0].data
    out: dict[str, object] = {"data_path": data.kind if data is not None else "grpc"}
    prefixes = range(args.first, args.first + args.count)
    if args.op == "save":
        stored = 0
        for p in prefixes:
            tokens, kv = prefix(p)
            stored += cache.save(tokens, lambda s, e, kv=kv: kv[:, :, s:e].tobytes())
        out["stored_chunks"] = stored
    elif args.op == "load":
        hits, wrong = [], 0
        for p in prefixes:
            tokens, kv = prefix(p)
            got = cache.load(tokens)
            hits.append(len(got.payloads))
            for i, payload in enumerate(got.payloads):
                s = i * LAYOUT.chunk_tokens
                if bytes(payload) != kv[:, :, s:s + LAYOUT.chunk_tokens].tobytes():
                    wrong += 1
        out.update(hit_chunks=hits, wrong_chunks=wrong,
                   missed_chunks=CHUNKS * args.count - sum(hits))
    else:
        start = time.monotonic()
        pending = set(prefixes)
        while pending and time.monotonic() - start < args.wait_s:
            pending = {p for p in pending if cache.lookup(prefix(p)[0]).chunks < CHUNKS}
            if pending:
                time.sleep(0.005)
        out.update(visible_s=time.monotonic() - start, pending=sorted(pending))
    cache.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()

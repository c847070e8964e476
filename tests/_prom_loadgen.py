"""Load generator for tests/test_prometheus.py: an engine-side kvtier client (local cpu tier
over a kvtier-server cluster) whose registry carries the library's series and the vLLM
connector's (``ConnectorMetrics``, driven as the connector's worker drives it), served over
HTTP for Prometheus to scrape.

    python tests/_prom_loadgen.py WORKDIR NODES TOKEN TENANT [--requests N] [--seed S]

Writes WORKDIR/ready.json ({"port": metrics port}) once /metrics is up, waits for
WORKDIR/go (the test creates it once Prometheus scrapes every target), then runs N requests:
each prompt is one of a few shared system prefixes plus a unique suffix, looked up, its hit
loaded and verified, the rest saved, like an engine's prefill. Then it writes WORKDIR/result.json
(prompt and hit tokens as the generator itself counted them) and serves /metrics until
SIGTERM. Any exception ends the process with a traceback (the test reports it).
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import threading
import time
from pathlib import Path

import numpy as np
from kvtier_vllm.metrics import ConnectorMetrics
from prometheus_client import start_http_server

from kvtier.cache import PrefixCache
from kvtier.config import KVTierConfig
from kvtier.keys import KVLayout, NamespaceSpec

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=16)  # 8 KiB chunks
SPEC = NamespaceSpec("prom-test-model", LAYOUT, kv_dtype="float16")
PREFIXES = 32  # shared system prompts, 3 chunks each: more than the local tier holds
PREFIX_TOKENS = 3 * LAYOUT.chunk_tokens


def open_cache(nodes: list[str], token: str, tenant: str) -> PrefixCache:
    # A 64-slot local tier under ~500 chunks of traffic: hits come from both tiers and it evicts.
    cfg = KVTierConfig.from_dict({
        "chunk_tokens": LAYOUT.chunk_tokens, "tenant": tenant,
        "cpu": {"capacity_bytes": "1MiB", "slot_bytes": "16KiB"},
        "grpc": {"enabled": True, "nodes": nodes, "token": token, "timeout_s": 5.0},
    })
    return PrefixCache.open(cfg, SPEC)


def run(cache: PrefixCache, cm: ConnectorMetrics, requests: int, seed: int) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 32000, PREFIX_TOKENS).tolist() for _ in range(PREFIXES)]
    per_token = math.prod(LAYOUT.chunk_shape(1)) * 2  # float16 bytes of one token's K/V
    prompt_tokens = hit_tokens = loaded_tokens = 0
    by_tier: dict[str, int] = {}
    for i in range(requests):
        suffix = rng.integers(0, 32000, int(rng.integers(8, 48))).tolist()
        tokens = prefixes[int(rng.integers(0, PREFIXES))] + suffix
        hit = cache.lookup(tokens, full_chunks_only=True)
        prompt_tokens += len(tokens)
        hit_tokens += hit.tokens
        for tier, chunks in hit.per_tier.items():  # whole chunks only (full_chunks_only)
            by_tier[tier] = by_tier.get(tier, 0) + chunks * LAYOUT.chunk_tokens
        if hit.tokens:
            t0 = time.perf_counter()
            loaded = cache.load(tokens, max_tokens=hit.tokens, full_chunks_only=True)
            cm.load_seconds.observe(time.perf_counter() - t0)
            for tier, chunks in loaded.per_tier.items():
                cm.load_tokens.labels(tier).inc(chunks * LAYOUT.chunk_tokens)
            loaded_tokens += loaded.tokens
            if loaded.tokens < hit.tokens:
                cm.load_failures.labels(loaded.reason).inc()

        def payload_for(start: int, end: int, i: int = i) -> bytes:
            return bytes([i % 251]) * ((end - start) * per_token)

        cm.save_chunks.inc(cache.save(tokens, payload_for, full_chunks_only=True))
        time.sleep(0.01)  # spread the load over several scrapes
    return {"requests": requests, "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
            "loaded_tokens": loaded_tokens, "hit_tokens_by_tier": by_tier}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("nodes", help="host:port,host:port")
    ap.add_argument("token")
    ap.add_argument("tenant")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=12)
    args = ap.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cache = open_cache(args.nodes.split(","), args.token, args.tenant)
    cm = ConnectorMetrics(cache.metrics)
    httpd, _ = start_http_server(0, addr="127.0.0.1", registry=cache.metrics.registry)
    (args.workdir / "ready.json").write_text(json.dumps({"port": httpd.server_port}))
    go = args.workdir / "go"
    while not go.exists() and not stop.is_set():
        time.sleep(0.05)
    started = time.time()
    result = run(cache, cm, args.requests, args.seed)
    result.update(started=started, finished=time.time())
    (args.workdir / "result.json").write_text(json.dumps(result))
    stop.wait()
    httpd.shutdown()
    cache.close()


if __name__ == "__main__":
    main()

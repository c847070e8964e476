"""The capacity and traffic figures operators read: a full tier reads full, and a rate panel
sees a series' first hits.

Ground truth is what the tier does: a put into a full cpu tier evicts, so its
``used_bytes / capacity_bytes`` must be 1 by then, however small the chunks are in their
slots (100 KB chunks in 1 MiB slots read 10% used while evicting, before). A series born at
its first sample hides that sample from ``rate()``, so the server's hit and miss series must
exist at 0 from the first scrape.
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import grpc

from kvtier.config import CpuTierConfig
from kvtier.metrics import MISS_REASONS
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc
from kvtier.tiers.base import Entry
from kvtier.tiers.cpu import CpuTier
from tests.kvtier_servers import make_chunk, make_keys, start_server

SLOT = 1 << 20
SMALL_CHUNK = 100_000  # payload bytes: a tenth of a slot


def _sample(text: str, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` with exactly ``labels``, None when absent."""
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        m = re.match(r"^" + name + r"\{([^}]*)\} (\S+)$", line)
        if m and sorted(m.group(1).split(",")) == want:
            return float(m.group(2))
    return None


def test_cpu_tier_reads_full_exactly_when_a_put_must_evict() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=4 * SLOT, slot_bytes=SLOT, pin_memory="never"))
    try:
        keys = make_keys(5, seed=1)
        chunks = [make_chunk(k, SMALL_CHUNK, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys[:3], chunks)]) == [True] * 3
        u = tier.usage()
        assert (u.used_bytes, u.chunk_bytes, u.entries) == (3 * SLOT, sum(map(len, chunks[:3])), 3)
        assert tier.put([Entry(keys[3], chunks[3])]) == [True]
        u = tier.usage()
        assert u.used_bytes == u.capacity_bytes and u.evictions == 0  # full: the next put evicts
        assert tier.put([Entry(keys[4], chunks[4])]) == [True]
        u = tier.usage()
        assert u.evictions == 1 and u.used_bytes == u.capacity_bytes
        assert u.chunk_bytes == sum(map(len, chunks[1:])) == tier.used_bytes  # the pool's figure
        assert tier.delete([keys[4]]) == 1
        assert tier.usage().used_bytes == 3 * SLOT and tier.check() == []
    finally:
        tier.close()


def test_server_figures_full_ram_tier_and_hit_series_from_the_start(tmp_path: Path) -> None:
    """A real RAM-only node with 8 slots of 1 MiB: before any request every hit/miss series
    reads 0; 8 chunks of ~100 KB fill it (used = capacity in /metrics and /api/stats, while the
    RAM budget, which counts chunk bytes, is far from full) and a 9th evicts."""
    server = start_server(tmp_path, "--cpu-bytes", "8MiB", "--slot-bytes", "1MiB")
    try:
        first = server.metrics()
        for op in ("lookup", "get"):
            assert _sample(first, "kvtier_server_hit_chunks_total", tenant="default", tier="cpu", op=op) == 0
            for reason in MISS_REASONS:
                got = _sample(first, "kvtier_server_miss_chunks_total", tenant="default", reason=reason, op=op)
                assert got == 0, (op, reason, got)
        keys = make_keys(9, seed=2)
        chunks = [make_chunk(k, SMALL_CHUNK, i) for i, k in enumerate(keys)]
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.KVTierStub(channel)
            items = [pb.PutItem(key=k, chunk=c, depth=i) for i, (k, c) in enumerate(zip(keys, chunks))]
            assert list(stub.Put(iter([pb.PutRequest(items=items[:8])]), timeout=10).stored) == [True] * 8
            text = server.metrics()
            labels = {"tenant": "default", "tier": "cpu"}
            assert _sample(text, "kvtier_server_tier_used_bytes", **labels) == 8 * SLOT
            assert _sample(text, "kvtier_server_tier_capacity_bytes", **labels) == 8 * SLOT
            assert _sample(text, "kvtier_server_tier_chunk_bytes", **labels) == sum(map(len, chunks[:8]))
            assert _sample(text, "kvtier_server_evictions_total", **labels) == 0
            with urllib.request.urlopen(server.http + "/api/stats", timeout=5) as r:
                [cpu] = json.loads(r.read())["tenants"][0]["tiers"]
            assert cpu["used_bytes"] == cpu["capacity_bytes"] == 8 * SLOT
            assert list(stub.Put(iter([pb.PutRequest(items=items[8:])]), timeout=10).stored) == [True]
            assert _sample(server.metrics(), "kvtier_server_evictions_total", **labels) == 1
    finally:
        assert server.stop() == 0, server.log

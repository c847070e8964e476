"""The SGLang backend's engine usage reports reach a real kvtier-server: L3 lookups, hits by
tier, restores and prefill saved, as the controller's calls produced them (usage.py)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
from kvtier_servers import start_server
from pools import fill_random, mha_pools, pages_of, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 4


def _usage(http: str) -> dict[str, Any]:
    with urllib.request.urlopen(http + "/api/stats", timeout=5) as reply:
        return json.loads(reply.read())["usage"]  # type: ignore[no-any-return]


def test_backend_reports_l3_usage_to_the_node(tmp_path: Path) -> None:
    node = start_server(tmp_path / "node")
    try:
        tiers = {"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": [node.address]},
                 "usage": {"interval_s": 60, "replica_id": "sglang-replica-1"}}
        _, host = mha_pools("page_first")
        backend = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", tiers), host)
        backend.register_mem_pool_host(host)
        stored = get_storage_hash_str(list(range(500, 500 + 3 * PAGE)), None, page_size=PAGE)
        other = get_storage_hash_str(list(range(700, 700 + 2 * PAGE)), None, page_size=PAGE)
        src = host.alloc(3 * PAGE)
        fill_random(host, seed=5)
        ref = pages_of(host, src, PAGE)
        assert backend.batch_set_v1(stored, src) == [True] * 3
        backend._store.flush(5.0)
        # A prefetch query over 3 stored pages + 2 unknown ones: 3 hit, then a miss.
        assert backend.batch_exists(stored + other) == 3
        dst = host.alloc(3 * PAGE)
        assert backend.batch_get_v1(stored, dst) == [True] * 3
        assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst, PAGE), ref))
        assert backend.batch_exists(other) == 0
        backend.usage.reporter.send_now(5.0)
        deadline, reps = time.monotonic() + 10, []
        while time.monotonic() < deadline:
            reps = [r for r in _usage(node.http)["replicas"] if r["replica"] == "sglang-replica-1"]
            if reps and reps[0]["totals"].get("prompt_tokens"):
                break
            time.sleep(0.1)
        assert len(reps) == 1 and reps[0]["source"] == "sglang", reps
        t = reps[0]["totals"]
        assert t["prompt_tokens"] == (5 + 2) * PAGE
        assert t["hit_tokens/grpc"] == 3 * PAGE
        assert t["miss_tokens/absent"] == 4 * PAGE
        assert t["restored_tokens"] == 3 * PAGE == t["prefill_tokens_saved"]
        assert t.get("load_failures", 0) == 0
        backend.close()
    finally:
        node.stop()

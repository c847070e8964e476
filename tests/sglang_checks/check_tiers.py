"""KVTierStorage over every kvtier tier: a page one backend stores, a fresh backend (another
instance, its own empty process-local state) restores exactly, through that tier alone.

Real media: files for disk, a real redis-server, a real kvtier-server process.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier_servers import start_server
from pools import fill_random, mha_pools, pages_of, storage_config
from redis_servers import RedisServer, have_redis
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

PAGE = 4


@pytest.fixture(params=["cpu", "disk", "redis", "kvtier-server"])
def tier_config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    name = request.param
    if name == "cpu":
        yield {}
    elif name == "disk":
        yield {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path / "disk")}}
    elif name == "redis":
        if not have_redis():
            pytest.skip("redis-server not installed (scripts/test.sh installs it)")
        server = RedisServer().start()
        try:
            yield {"cpu": {"enabled": False}, "redis": {"enabled": True, "url": server.url}}
        finally:
            server.cleanup()
    else:
        node = start_server(tmp_path / "node")
        try:
            yield {"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": [node.address]}}
        finally:
            node.stop()


def test_pages_roundtrip_through_each_tier(tier_config: dict[str, Any]) -> None:
    tokens = list(range(900, 900 + 3 * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    _, w_host = mha_pools("page_first")
    writer = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", tier_config), w_host)
    writer.register_mem_pool_host(w_host)
    src = w_host.alloc(3 * PAGE)
    fill_random(w_host, seed=11)
    ref = pages_of(w_host, src, PAGE)
    assert writer.batch_set_v1(keys, src) == [True] * 3
    if tier_config:
        writer.close()  # flushes the write-behind queue into the shared tier
        _, r_host = mha_pools("page_first")
        reader = StorageBackendFactory.create_backend("dynamic", storage_config("page_first", tier_config), r_host)
        reader.register_mem_pool_host(r_host)
    else:
        reader, r_host = writer, w_host  # the cpu tier lives in the process: same backend
    assert reader.batch_exists(keys) == 3
    dst = r_host.alloc(3 * PAGE)
    assert reader.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(r_host, dst, PAGE), ref))
    reader.close()

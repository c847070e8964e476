"""One cache across engines on a kvtier-server cluster of two nodes (real server processes).

The grpc tier places each page of a prefix by its group's first key (grpc.group_chunks, 8 by
default; docs/placement.md). The vLLM and transformers connectors store and look up with the
whole prefix (PrefixCache.store_chunks / save / load); the SGLang backend placed every page by
itself, so it found 1 of 16 pages another engine stored, and the others 1 of 16 of SGLang's
(audit). With SGLang's ``hicache_storage_pass_prefix_keys`` on, the backend now passes each
call's whole prefix (SGLang's ``prefix_keys`` + the call's keys) and both find every page.

Runs in the SGLang venv only (started by tests/test_sglang.py).
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from check_backend import make
from kvtier_servers import start_server
from kvtier_sglang import KVTierStorage
from kvtier_sglang.namespace import store_keys
from kvtier_sglang.pages import page_view
from kvtier_sglang.xengine import load_pages, save_pages
from pools import BACKEND, fill_random, mha_pools
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo as Info
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE, N = 4, 16
FLAG = {"hicache_storage_pass_prefix_keys": True}  # what a hand-built controller's backend sees


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    root: Path = tmp_path_factory.mktemp("cluster")
    nodes = [start_server(root / f"n{i}", name=f"n{i}") for i in range(2)]
    try:
        yield [n.address for n in nodes]
    finally:
        for node in nodes:
            node.stop()


def backend(nodes: list[str], extra: dict[str, Any]) -> KVTierStorage:
    grpc = {"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": nodes}}
    return make(mha_pools("page_first", size=128)[1], "page_first", {**grpc, **extra})


def canonical(be: KVTierStorage, slots: torch.Tensor) -> list[bytes]:
    """Each page's bytes in kvtier's canonical order: what every engine stores."""
    assert be._geo is not None
    return [page_view(be._geo, be.mem_pool_host.kv_buffer, int(slots[i * PAGE])).contiguous()
            .view(torch.uint8).numpy().tobytes() for i in range(slots.numel() // PAGE)]


def test_sglang_and_the_other_engines_find_each_others_pages(cluster: list[str]) -> None:
    be = backend(cluster, FLAG)
    assert be._cache is not None and be._store is not None
    cache, tier = be._cache, be._store.tiers[0]
    host = be.mem_pool_host
    keys = get_storage_hash_str(list(range(500, 500 + N * PAGE)), None, page_size=PAGE)
    xkeys = store_keys(be.namespace, keys)
    assert tier.placement(xkeys) != tier.placement(xkeys, xkeys)  # premise: the prefix moves pages
    src = host.alloc(N * PAGE)
    fill_random(host, seed=3)
    pages = canonical(be, src)
    # kvtier_vllm and kvtier_hf store through PrefixCache with the whole prefix
    assert cache.store_chunks(xkeys, list(range(N)), lambda i: pages[i]) == N
    assert be.batch_exists(keys, Info(prefix_keys=[])) == N
    assert be.batch_exists(keys, Info(prefix_keys=None)) == N   # the hybrid hit query's empty prefix
    assert be.batch_exists(keys[5:], Info(prefix_keys=keys[:5])) == N - 5
    dst = host.alloc(N * PAGE)
    host.kv_buffer.zero_()
    got = (be.batch_get_v1(keys[:9], dst[:9 * PAGE], Info(prefix_keys=[]))
           + be.batch_get_v1(keys[9:], dst[9 * PAGE:], Info(prefix_keys=keys[:9])))
    assert got == [True] * N and canonical(be, dst) == pages
    # SGLang stores (two backup batches); the other engines' lookup and load find every page
    tokens = list(range(9000, 9000 + N * PAGE))
    keys2 = get_storage_hash_str(tokens, None, page_size=PAGE)
    fill_random(host, seed=4)
    pages2 = canonical(be, src)
    assert all(be.batch_set_v1(keys2[:7], src[:7 * PAGE], Info(prefix_keys=[])))
    assert all(be.batch_set_v1(keys2[7:], src[7 * PAGE:], Info(prefix_keys=keys2[:7])))
    x2 = store_keys(be.namespace, keys2)
    assert cache.store.lookup(x2, prefix=x2).hits == N
    loaded = load_pages(cache, tokens)             # the token side (kvtier_sglang.xengine)
    assert loaded.tokens == N * PAGE and [bytes(p) for p in loaded.payloads] == pages2
    # and the token side's writes are where SGLang looks
    tokens3 = list(range(20000, 20000 + N * PAGE))
    assert save_pages(cache, tokens3, lambda start, end: pages[start // PAGE]) == N
    keys3 = get_storage_hash_str(tokens3, None, page_size=PAGE)
    assert be.batch_exists(keys3, Info(prefix_keys=[])) == N
    be.close()


def test_without_prefix_keys_a_grouped_cluster_is_warned_about(cluster: list[str],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """With the flag off SGLang says nothing of a call's depth: pages are placed by themselves,
    which SGLang instances agree on but the other engines do not, so the attach warns."""
    caplog.set_level(logging.WARNING, logger="kvtier_sglang.prefix")
    be = backend(cluster, {})
    assert "hicache_storage_pass_prefix_keys" in caplog.text and "2 nodes" in caplog.text
    keys = get_storage_hash_str(list(range(30000, 30000 + N * PAGE)), None, page_size=PAGE)
    src = be.mem_pool_host.alloc(N * PAGE)
    assert all(be.batch_set_v1(keys, src, Info()))
    be.close()
    other = backend(cluster, {})
    assert other.batch_exists(keys, Info()) == N
    other.close()
    caplog.clear()
    one = backend(cluster[:1], {})  # one node: every page lives there, the prefix changes nothing
    assert "hicache_storage_pass_prefix_keys" not in caplog.text
    one.close()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    yield
    dist.destroy_process_group()


def test_sglangs_own_controller_threads_share_pages_with_the_other_engines(
        cluster: list[str], one_rank_group: None) -> None:
    """SGLang's HybridCacheController (the controller of every model in a 0.5.23 server) with
    the flag on: its prefetch thread's hit query sends a request's empty prefix as None, its
    IO and backup threads send the prefix list. Pages another engine stored are hit and
    restored exactly; pages SGLang's backup thread stored are where the other engines look."""
    dev, host = mha_pools("page_first", ratio=8.0, size=128)
    alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    group = HostPoolGroup([PoolEntry(name=PoolName.KV, host_pool=host, device_pool=dev,
                                     layer_mapper=lambda i: i, is_primary_index_anchor=True)])
    extra = {**BACKEND, "cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": cluster}, **FLAG}
    cc = HybridCacheController(alloc, group, PAGE, dist.group.WORLD, threading.Event(),
                               write_policy="write_through", io_backend="direct", storage_backend="dynamic",
                               prefetch_threshold=PAGE, model_name="tiny", storage_backend_extra_config=extra)
    be = cc.storage_backend
    assert isinstance(be, KVTierStorage) and be._cache is not None
    tokens = list(range(40000, 40000 + N * PAGE))
    xkeys = store_keys(be.namespace, get_storage_hash_str(tokens, None, page_size=PAGE))
    src = host.alloc(N * PAGE)
    fill_random(host, seed=5)
    pages = canonical(be, src)
    assert be._cache.store_chunks(xkeys, list(range(N)), lambda i: pages[i]) == N   # another engine
    op = cc.prefetch(CacheRequestHandle("r1", 0), tokens, None, prefix_keys=[])
    assert cc.prefetch_hit_queue.get(timeout=30).storage_hit_count == N * PAGE
    dst = cc.alloc_prefetch_host_buffers(op, N * PAGE)
    op.host_indices = dst
    host.kv_buffer.zero_()
    cc.prefetch_buffer.put(op)
    done = None
    while True:  # the IO thread's acks, as check_controller.py drains them
        ack = cc.ack_prefetch_queue.get(timeout=30)
        done = ack.completed_tokens if ack.completed_tokens is not None and done is None else done
        if getattr(ack, "completed_req", False):
            break
    assert done == N * PAGE and canonical(be, dst) == pages
    tokens2 = list(range(50000, 50000 + N * PAGE))
    keys2 = get_storage_hash_str(tokens2, None, page_size=PAGE)
    cc.write_storage(src, tokens2, hash_value=keys2, prefix_keys=[])
    assert cc.ack_backup_queue.get(timeout=30).completed_tokens == N * PAGE
    x2 = store_keys(be.namespace, keys2)
    assert be._cache.store.lookup(x2, prefix=x2).hits == N
    cc.detach_storage_backend()

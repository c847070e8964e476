"""What the attach decides, on SGLang's real classes: the namespace's weights revision from the
server's own configuration, cpu-tier slots fitted to the page, and the set-ups the backend
cannot serve refused loudly (MLA across TP ranks with no shared tier; hybrid sidecar pools).

Runs in the SGLang venv only (started by tests/test_sglang.py). Each of these was an audit
finding that passed every other check: two checkpoints served under one ``--served-model-name``
shared pages; a 4 MiB slot per 2 KiB page; an MLA TP=2 cache that stored and never hit; hybrid
models attached with every v2 call raising.
"""

from __future__ import annotations

import logging
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from check_backend import PAGE, keys_for, make
from kvtier_sglang import KVTierStorage
from pools import BACKEND, fill_random, mha_pools, mla_host, pages_of, storage_config
from sglang.srt import runtime_context
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.hicache_storage import PoolName
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.server_args import ServerArgs

from kvtier.chunk import HEADER_SIZE
from kvtier.errors import ConfigError


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Publish ``ServerArgs(**kw)`` as a server process does, in a runtime context of this test's
    own (restored afterwards: other checks run with nothing published)."""
    ctx = runtime_context.RuntimeContext(parallel=runtime_context.ParallelContext())
    monkeypatch.setattr(runtime_context, "_CONTEXT", ctx)

    def publish(**kw: Any) -> None:
        ctx.set_server_args(ServerArgs(**kw))

    return publish


def checkpoint(root: Path, name: str, weights: bytes) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text('{"architectures": ["TinyForCausalLM"]}')
    (path / "model.bin").write_bytes(weights * 4096)
    return str(path)


def test_checkpoints_served_under_one_name_never_share_pages(tmp_path: Path, serve: Callable[..., None]) -> None:
    """SGLang names the storage config's model after --served-model-name when one is given, so
    two fine-tunes served as "assistant" had one namespace and B restored A's K/V. The revision
    now comes from the checkpoint the server loaded (--model-path, --revision)."""
    disk = {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path / "l3")}}
    a, b = checkpoint(tmp_path, "A", b"\x01"), checkpoint(tmp_path, "B", b"\x02")
    tokens = list(range(3 * PAGE))

    def backend(model_path: str, **kw: Any) -> KVTierStorage:
        serve(model_path=model_path, served_model_name="assistant", **kw)
        return make(mha_pools("page_first")[1], "page_first", disk, model="assistant")

    writer = backend(a)
    src = writer.mem_pool_host.alloc(3 * PAGE)
    fill_random(writer.mem_pool_host, seed=1)
    assert all(writer.batch_set_v1(keys_for(tokens), src))
    writer.close()
    other = backend(b)
    assert other.namespace != writer.namespace and other.batch_exists(keys_for(tokens)) == 0
    same = backend(a)  # the same checkpoint under the same name: every page
    assert same.namespace == writer.namespace and same.batch_exists(keys_for(tokens)) == 3
    dst = same.mem_pool_host.alloc(3 * PAGE)
    assert same.batch_get_v1(keys_for(tokens), dst) == [True] * 3
    ref = pages_of(writer.mem_pool_host, src, PAGE)
    assert all(torch.equal(x, y) for x, y in zip(pages_of(same.mem_pool_host, dst, PAGE), ref))
    # A hub id is named by its --revision where the local cache does not hold it
    hub = [backend("org/not-cached", revision=r).namespace for r in ("v1", "v2", "v1")]
    assert hub[0] == hub[2] != hub[1]
    for be in (other, same):
        be.close()


def test_cpu_slots_hold_one_page_unless_slot_bytes_is_set(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """The cpu tier keeps one chunk per slot. With the 4 MiB default, --page-size 1 pages of
    2 KiB took a whole slot each: a 64 MiB tier held 16 pages, so a 40-token prompt "stored"
    True and then hit 0. Unset, a slot is one page chunk; a value set anywhere is kept, and
    one that wastes most of each slot is warned about."""
    page = 1

    def backend(cpu: dict[str, Any]) -> tuple[KVTierStorage, Any]:
        _, host = mha_pools("page_first", page=page, heads=2, head_dim=64, layers=4, size=128)
        cfg = storage_config("page_first", {"cpu": cpu})
        be = StorageBackendFactory.create_backend("dynamic", cfg, host)
        be.register_mem_pool_host(host)
        assert be._store is not None
        return be, be._store.tiers[0]

    be, tier = backend({"capacity_bytes": "64MiB"})
    assert be._geo is not None
    chunk = HEADER_SIZE + be._geo.page_bytes
    assert tier.slot_bytes == -(-chunk // 4096) * 4096 == 4096
    keys = get_storage_hash_str(list(range(40)), None, page_size=page)
    src = be.mem_pool_host.alloc(40)
    assert all(be.batch_set_v1(keys, src))
    assert be.batch_exists(keys) == 40
    be.close()
    caplog.set_level(logging.WARNING, logger="kvtier_sglang.namespace")
    be, tier = backend({"capacity_bytes": "64MiB", "slot_bytes": "64KiB"})  # chosen: kept, warned
    assert tier.slot_bytes == 64 << 10
    assert "cpu.slot_bytes" in caplog.text and "unused" in caplog.text
    be.close()
    monkeypatch.setenv("KVTIER_CPU__SLOT_BYTES", "8KiB")  # chosen in the environment: kept too
    be, tier = backend({"capacity_bytes": "64MiB"})
    assert tier.slot_bytes == 8 << 10
    be.close()
    monkeypatch.delenv("KVTIER_CPU__SLOT_BYTES")
    be, tier = backend({"capacity_bytes": "64MiB", "slot_bytes": 4096 * 2})
    assert tier.slot_bytes == 8192  # wastes under 3/4 of a slot: kept (warned)
    be.close()
    _, big = mha_pools("page_first", heads=2, head_dim=64, layers=4, size=128)  # 8 KiB + header
    be = make(big, "page_first", {"cpu": {"capacity_bytes": "64MiB", "slot_bytes": "8KiB"}})
    assert be._store is not None and be._store.tiers[0].slot_bytes == 12288  # raised to fit
    be.close()


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-process gloo group, as check_controller.py; TP size is overridden per test."""
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    runtime_context.get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                                        attn_dcp_size=1, attn_dcp_rank=0)
    yield
    dist.destroy_process_group()


def mla_controller(extra: dict[str, Any], storage_backend: str | None) -> HiCacheController:
    dev = MLATokenToKVPool(64, PAGE, torch.bfloat16, kv_lora_rank=32, qk_rope_head_dim=8, layer_num=3,
                           device="cpu", enable_memory_saver=False, start_layer=0, end_layer=2)
    host = mla_host("page_first")
    alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    return HiCacheController(alloc, host, PAGE, tp_group=dist.group.WORLD, load_cache_event=threading.Event(),
                             write_policy="write_through", io_backend="direct", storage_backend=storage_backend,
                             prefetch_threshold=PAGE, model_name="tiny-mla", storage_backend_extra_config=extra)


def test_mla_across_tp_ranks_without_a_shared_tier_fails_the_attach(one_rank_group: None, tmp_path: Path) -> None:
    """SGLang backs an MLA page up on its storage-writer rank only and MIN-reduces the hit over
    the TP group: with only the process-local cpu tier the other ranks never hold a page, so
    L3 stored and never served (audit: TP=2, hit 0 forever). The attach now fails, at start
    and at runtime, and leaves the controller without a backend; a shared tier attaches."""
    cpu_only = {**BACKEND, "cpu": {"capacity_bytes": "64MiB"}}
    with pytest.raises(ConfigError, match=r"disk.enabled / redis.enabled / grpc.enabled.*tp_size 2"):
        make(mla_host("page_first"), "page_first", {}, mla=True, tp_rank=1, tp_size=2)
    with runtime_context.get_parallel().override(tp_size=2, tp_rank=1):
        with pytest.raises(ValueError, match="Failed to create storage backend: disk.enabled"):
            mla_controller(cpu_only, "dynamic")                              # at start
        cc = mla_controller(cpu_only, None)
        with pytest.raises(ConfigError, match="tier its TP ranks share"):
            cc.attach_storage_backend("dynamic", PAGE, "tiny-mla", dict(cpu_only))  # at runtime
        assert not cc.enable_storage and cc.storage_backend is None
        disk = {**cpu_only, "disk": {"enabled": True, "path": str(tmp_path)}}
        cc.attach_storage_backend("dynamic", PAGE, "tiny-mla", disk)
        assert cc.enable_storage and cc.backup_skip                         # rank 1: not the writer
        cc.detach_storage_backend()
    mla_controller(cpu_only, "dynamic").detach_storage_backend()             # one rank: attaches


def hybrid_controller(entries: list[tuple[PoolName, Any]], storage_backend: str | None) -> HybridCacheController:
    dev, host = mha_pools("page_first", ratio=8.0)
    group = HostPoolGroup([PoolEntry(name=name, host_pool=host if pool is None else pool, device_pool=dev,
                                     layer_mapper=lambda i: i, is_primary_index_anchor=name == PoolName.KV)
                           for name, pool in entries])
    alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    return HybridCacheController(alloc, group, PAGE, dist.group.WORLD, threading.Event(),
                                 write_policy="write_through", io_backend="direct",
                                 storage_backend=storage_backend, prefetch_threshold=PAGE, model_name="tiny",
                                 storage_backend_extra_config={**BACKEND, "cpu": {"capacity_bytes": "64MiB"}})


def test_hybrid_sidecar_pools_fail_the_attach(one_rank_group: None) -> None:
    """A hybrid model's sidecar pools (SWA, Mamba, DSA indexer) move through batch_*_v2, which
    the backend does not implement: they were accepted at attach and every v2 call raised
    NotImplementedError. SGLang's HybridCacheController (every model's controller in a 0.5.23
    server) registers its pools and calls on_host_pools_registered, which now refuses them."""
    kv_only = hybrid_controller([(PoolName.KV, None)], "dynamic")  # the KV anchor alone: served
    be = kv_only.storage_backend
    assert isinstance(be, KVTierStorage) and list(be.registered_pools) == [PoolName.KV]
    keys = keys_for(list(range(2 * PAGE)))
    assert all(be.batch_set_v1(keys, be.mem_pool_host.alloc(2 * PAGE))) and be.batch_exists(keys) == 2
    with pytest.raises(ConfigError, match=r"sidecar pools \['mamba'\]"):  # a sidecar added later
        be.register_mem_host_pool_v2(mha_pools("page_first")[1], PoolName.MAMBA)
    assert be.batch_exists(keys) == 0                                      # closed: nothing half-works
    kv_only.detach_storage_backend()
    side = mha_pools("page_first", ratio=8.0)[1]
    with pytest.raises(ConfigError, match=r"sidecar pools \['swa'\].*batch_\*_v2"):
        hybrid_controller([(PoolName.KV, None), (PoolName.SWA, side)], "dynamic")   # at start
    cc = hybrid_controller([(PoolName.KV, None), (PoolName.SWA, side)], None)
    with pytest.raises(ConfigError, match="swa"):                           # at runtime
        cc.attach_storage_backend("dynamic", PAGE, "tiny", {**BACKEND, "cpu": {"capacity_bytes": "64MiB"}},
                                  host_pools=cc.mem_pool_host.entries)
    # SGLang's hybrid attach does not roll back when the hook raises (its threads run on):
    # the backend closed its store, so every call fails per page instead of half-working.
    refused = cc.storage_backend
    assert refused is not None and refused.batch_exists(keys) == 0
    assert refused.batch_set_v1(keys, cc.mem_pool_host.alloc(2 * PAGE)) == [False, False]
    cc.detach_storage_backend()

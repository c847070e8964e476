"""KVTierStorage on SGLang's real classes: factory loader, host pools of every layout, tiers.

Runs in the SGLang venv only (started by tests/test_sglang.py). Every backend here is built by
SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)`` from the extra-config
dict a server would get, over real ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` pools;
page keys come from SGLang's own ``get_storage_hash_str``.
"""

from __future__ import annotations

import ctypes
import json
from array import array
from pathlib import Path
from typing import Any

import pytest
import torch
from fakes import FaultyTier, RaisingTier
from kvtier_sglang import KVTierStorage
from kvtier_sglang.pages import geometry_of, page_view
from pools import (
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    fill_random,
    mha_pools,
    mla_host,
    pages_of,
    storage_config,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvtier.errors import ConfigError
from kvtier.keys import page_hash_seed, page_hashes
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier

PAGE = 4


def make(host: Any, layout: str, extra: dict[str, Any] | None = None, *, mla: bool = False,
         **kw: Any) -> KVTierStorage:
    be = StorageBackendFactory.create_backend("dynamic", storage_config(layout, extra, mla=mla, **kw), host)
    assert isinstance(be, KVTierStorage) and isinstance(be, HiCacheStorage)
    be.register_mem_pool_host(host)  # what HiCacheController.attach_storage_backend does next
    be.on_host_pools_registered()
    return be


def keys_for(tokens: list[int], **namespace: str) -> list[str]:
    out = get_storage_hash_str(RadixKey(array("q", tokens), **namespace), None, page_size=PAGE)
    assert isinstance(out, list)
    return out


def host_for(layout: str, mla: bool) -> Any:
    return mla_host(layout) if mla else mha_pools(layout)[1]


ALL = [(lay, False) for lay in MHA_LAYOUTS] + [(lay, True) for lay in MLA_LAYOUTS]
IDS = [f"{'mla' if m else 'mha'}-{lay}" for lay, m in ALL]


@pytest.mark.parametrize(("layout", "mla"), ALL, ids=IDS)
def test_factory_backend_roundtrips_pages_of_every_host_layout(layout: str, mla: bool) -> None:
    host = host_for(layout, mla)
    be = make(host, layout, mla=mla)
    keys = keys_for(list(range(100, 100 + 3 * PAGE)))
    src = host.alloc(3 * PAGE)
    fill_random(host, seed=1)
    ref = pages_of(host, src, PAGE)
    assert be.batch_exists(keys, HiCacheStorageExtraInfo()) == 0
    assert be.batch_set_v1(keys, src, HiCacheStorageExtraInfo(prefix_keys=None)) == [True] * 3
    assert be.batch_exists(keys) == 3
    dst = host.alloc(3 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst, PAGE), ref))
    assert be.batch_get_v1(["0" * 64], host.alloc(PAGE)) == [False]     # a miss: a list, not None
    assert be.batch_set_v1(keys, src) == [True] * 3                       # already stored
    stats = be.kvtier_stats()
    assert stats["pages_written"] == 3 and stats["pages_already_stored"] == 3
    metrics = be.get_stats()
    assert metrics.prefetch_pgs == [3] and metrics.backup_pgs == [3]
    be.close()


@pytest.mark.parametrize(("layout", "mla"), ALL, ids=IDS)
def test_page_views_cover_exactly_the_bytes_sglang_names_for_a_page(layout: str, mla: bool) -> None:
    """Our canonical view of a page spans exactly the (ptr, size) ranges of SGLang's own
    ``get_page_buffer_meta`` for that page: nothing outside, nothing missing."""
    host = host_for(layout, mla)
    geo = geometry_of(host, mla)
    host.kv_buffer.zero_()
    slots = host.alloc(2 * PAGE)
    second = slots[PAGE:]
    page_view(geo, host.kv_buffer, int(second[0])).view(torch.uint8).fill_(1)
    ptrs, sizes = host.get_page_buffer_meta(second)
    assert all(ctypes.string_at(p, s) == b"\x01" * s for p, s in zip(ptrs, sizes))
    assert int(host.kv_buffer.view(torch.uint8).count_nonzero()) == sum(sizes) == geo.page_bytes


@pytest.mark.parametrize(("writer", "reader", "mla"), [
    ("layer_first", "page_head", False), ("page_first", "page_first_direct", False),
    ("page_head", "layer_first", False), ("page_first", "layer_first", True),
    ("layer_first", "page_first_direct", True)])
def test_pages_written_by_one_layout_restore_exactly_into_another(tmp_path: Path, writer: str,
                                                                  reader: str, mla: bool) -> None:
    """Two instances with different --hicache-mem-layout share one disk tier: the reader gets
    the writer's K/V, element for element (pages are stored in canonical order)."""
    extra = {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path)}}
    keys = keys_for(list(range(7, 7 + 2 * PAGE)))
    w_host, r_host = host_for(writer, mla), host_for(reader, mla)
    w, r = make(w_host, writer, extra, mla=mla), make(r_host, reader, extra, mla=mla)
    src = w_host.alloc(2 * PAGE)
    fill_random(w_host, seed=2)
    assert all(w.batch_set_v1(keys, src))
    w.close()
    dst = r_host.alloc(2 * PAGE)
    assert r.batch_get_v1(keys, dst) == [True, True]
    wg, rg = geometry_of(w_host, mla), geometry_of(r_host, mla)
    for i in range(2):
        a = page_view(wg, w_host.kv_buffer, int(src[i * PAGE]))
        b = page_view(rg, r_host.kv_buffer, int(dst[i * PAGE]))
        assert torch.equal(a, b)
    r.close()


def test_batch_exists_counts_leading_pages_only() -> None:
    _, host = mha_pools("page_first")
    be = make(host, "page_first")
    keys = keys_for(list(range(4 * PAGE)))
    src = host.alloc(4 * PAGE)
    fill_random(host, seed=3)
    for i in (0, 1, 3):                                           # page 2 never stored
        assert be.batch_set_v1(keys[i:i + 1], src[i * PAGE:(i + 1) * PAGE]) == [True]
    assert be.batch_exists(keys) == 2
    assert be.batch_exists(keys[3:]) == 1
    assert be.batch_get_v1(keys, host.alloc(4 * PAGE)) == [True, True, False, False]


def test_tenants_with_other_extra_key_or_cache_salt_see_nothing(tmp_path: Path) -> None:
    """SGLang seeds its page chain with the request's extra_key / cache_salt; kvtier keys on that
    chain, so another tenant's (or the unsalted) lookup of the same tokens misses."""
    _, host = mha_pools("page_first")
    be = make(host, "page_first")
    tokens = list(range(50, 50 + 2 * PAGE))
    src = host.alloc(2 * PAGE)
    fill_random(host, seed=4)
    assert all(be.batch_set_v1(keys_for(tokens, cache_salt="tenant-a"), src))
    assert be.batch_exists(keys_for(tokens, cache_salt="tenant-a")) == 2
    assert be.batch_exists(keys_for(tokens, cache_salt="tenant-b")) == 0
    assert be.batch_exists(keys_for(tokens)) == 0
    assert be.batch_exists(keys_for(tokens, extra_key="tenant-a")) == 0
    assert be.batch_get_v1(keys_for(tokens, cache_salt="tenant-b"), host.alloc(2 * PAGE)) == [False] * 2
    # salt_hex separates deployments sharing one tier, for the same page chain
    disk = {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path)}}
    a = make(host, "page_first", {**disk, "salt_hex": "aa"})
    b = make(mha_pools("page_first")[1], "page_first", {**disk, "salt_hex": "bb"})
    assert all(a.batch_set_v1(keys_for(tokens), src))
    assert b.batch_exists(keys_for(tokens)) == 0
    a.close()
    b.close()


@pytest.mark.parametrize("namespace", [{}, {"cache_salt": "t1"}, {"extra_key": "lora-7"},
                                       {"extra_key": "", "cache_salt": "x"}])
def test_x1_page_chain_is_sglangs_native_page_hash(namespace: dict[str, str]) -> None:
    tokens = [0, 1, 2**31 + 5, 2**32 - 1, *range(1000, 1000 + 3 * PAGE)]
    native = [bytes.fromhex(h) for h in keys_for(tokens, **namespace)]
    seed = page_hash_seed(namespace.get("extra_key"), namespace.get("cache_salt"))
    assert page_hashes(tokens, PAGE, seed, include_partial=True) == native


def test_x1_vectors_page_chain_is_what_sglang_computes() -> None:
    vectors = json.loads((Path(__file__).parents[1] / "vectors" / "keys_x1.json").read_text())
    for case in vectors:
        page = case["layout"]["chunk_tokens"]
        key = RadixKey(array("q", case["tokens"]), extra_key=case["extra_key"], cache_salt=case["cache_salt"])
        native = get_storage_hash_str(key, None, page_size=page)
        assert native[: len(case["tokens"]) // page] == case["page_hashes_hex"], case["model_id"]


def test_failures_are_per_page_false_and_counted_never_none_never_raised() -> None:
    _, host = mha_pools("layer_first")
    unregistered = KVTierStorage(storage_config("layer_first"), {})
    keys = keys_for(list(range(2 * PAGE)))
    assert unregistered.batch_exists(keys) == 0
    assert unregistered.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False, False]
    assert unregistered.batch_set_v1(keys, host.alloc(2 * PAGE)) == [False, False]
    be = make(host, "layer_first")
    src = host.alloc(2 * PAGE)
    assert all(be.batch_set_v1(keys, src))
    assert be.batch_get_v1(keys, host.alloc(PAGE)) == [False, False]        # too few indices
    assert be.batch_set_v1(keys, src[:3]) == [False, False]
    bad = host.alloc(2 * PAGE).flip(0)                                        # not whole pages
    assert be.batch_get_v1(keys, bad) == [False, False]
    stats = be.kvtier_stats()
    assert stats["get_errors"] == 2 and stats["set_errors"] == 1
    assert unregistered.kvtier_stats()["exists_errors"] == 1


def backend_over(tier: MemoryTier, layout: str) -> tuple[Any, KVTierStorage, TieredStore]:
    """A backend over a store of ``tier`` alone, on a fresh ``layout`` host pool."""
    _, host = mha_pools(layout)
    store = TieredStore([tier])
    be = KVTierStorage(storage_config(layout), {}, store=store)
    be.register_mem_pool_host(host)
    return host, be, store


def test_a_corrupt_or_failing_tier_never_restores_a_wrong_page() -> None:
    tier = FaultyTier(capacity_bytes=1 << 24)
    host, be, store = backend_over(tier, "page_head")
    keys = keys_for(list(range(3 * PAGE)))
    src = host.alloc(3 * PAGE)
    fill_random(host, seed=5)
    ref = pages_of(host, src, PAGE)
    assert all(be.batch_set_v1(keys, src))
    tier.corrupt(be_keys(be, keys)[1])
    dst = host.alloc(3 * PAGE)
    host.kv_buffer.view(torch.uint8)[...] = 0  # a restored page must be exactly ref, not leftovers
    got = be.batch_get_v1(keys, dst)
    assert got == [True, False, False]
    pages = pages_of(host, dst, PAGE)
    assert torch.equal(pages[0], ref[0])
    assert not pages[1].view(torch.uint8).any() and not pages[2].view(torch.uint8).any()
    assert be.batch_exists(keys) == 1                       # the corrupt chunk was deleted
    tier.down = True
    assert be.batch_exists(keys) == 0
    assert be.batch_get_v1(keys, dst) == [False] * 3
    assert be.batch_set_v1(keys, src) == [False] * 3
    store.close()


def test_an_unexpected_exception_fails_the_pages_and_never_reaches_sglang(caplog: pytest.LogCaptureFixture) -> None:
    """An exception SGLang's prefetch or backup thread would die of (here a KeyError from a
    buggy tier) is a per-page False like any failure, logged with its traceback."""
    tier = RaisingTier("buggy", times=0, verbs=("probe", "contains", "get_into", "put"), capacity_bytes=1 << 24)
    host, be, store = backend_over(tier, "layer_first")
    keys = keys_for(list(range(2 * PAGE)))
    src = host.alloc(2 * PAGE)
    assert all(be.batch_set_v1(keys, src))
    tier.times = -1  # every verb raises from now on
    assert be.batch_exists(keys) == 0
    assert be.batch_get_v1(keys, host.alloc(2 * PAGE)) == [False, False]
    assert be.batch_set_v1(keys[:1] + keys_for(list(range(100, 100 + PAGE))), src) == [False, False]
    stats = be.kvtier_stats()
    assert stats["exists_errors"] == 1 and stats["get_errors"] == 1 and stats["set_errors"] == 1
    assert "unexpected KeyError" in caplog.text and "a bug in a tier" in caplog.text
    tier.times = 0
    assert be.batch_exists(keys) == 2
    store.close()


def be_keys(be: KVTierStorage, keys: list[str]) -> list[bytes]:
    from kvtier_sglang.namespace import store_keys

    return store_keys(be.namespace, keys)


def test_legacy_tensor_interface_interoperates_with_v1() -> None:
    _, host = mha_pools("page_first_direct")
    extra = {"interface_v1": 0}
    be = make(host, "page_first_direct", extra)
    keys = keys_for(list(range(300, 300 + 2 * PAGE)))
    src = host.alloc(2 * PAGE)
    fill_random(host, seed=6)
    ref = pages_of(host, src, PAGE)
    assert be.batch_set(keys, [host.get_data_page(int(src[i * PAGE])) for i in range(2)])
    assert be.exists(keys[0]) and be.batch_exists(keys) == 2
    got = be.batch_get(keys, [host.get_dummy_flat_data_page() for _ in keys])
    assert all(g is not None and torch.equal(g, r) for g, r in zip(got, ref))
    dst = host.alloc(2 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst, PAGE), ref))
    assert be.get("f" * 64, host.get_dummy_flat_data_page()) is None


def test_clear_removes_this_backends_pages() -> None:
    _, host = mha_pools("page_first")
    be = make(host, "page_first")
    keys = keys_for(list(range(2 * PAGE)))
    assert all(be.batch_set_v1(keys, host.alloc(2 * PAGE)))
    be.clear()
    assert be.batch_exists(keys) == 0


def test_mla_latent_written_once_when_ranks_share_a_tier(tmp_path: Path) -> None:
    disk = {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path)}}
    keys = keys_for(list(range(2 * PAGE)))
    h0, h1 = mla_host("page_first"), mla_host("page_first")
    r0 = make(h0, "page_first", disk, mla=True, tp_rank=0, tp_size=2)
    r1 = make(h1, "page_first", disk, mla=True, tp_rank=1, tp_size=2)
    fill_random(h1, seed=7)
    assert r1.batch_set_v1(keys, h1.alloc(2 * PAGE)) == [True, True]   # not the writer rank
    assert r0.batch_exists(keys) == r1.batch_exists(keys) == 0
    src = h0.alloc(2 * PAGE)
    fill_random(h0, seed=8)
    assert all(r0.batch_set_v1(keys, src))
    assert r0.batch_exists(keys) == r1.batch_exists(keys) == 2       # one copy, both ranks see it
    dst = h1.alloc(2 * PAGE)
    assert r1.batch_get_v1(keys, dst) == [True, True]
    assert all(torch.equal(a, b) for a, b in zip(pages_of(h1, dst, PAGE), pages_of(h0, src, PAGE)))
    # MHA: each TP rank holds its own heads, so rank 1 does not see rank 0's pages
    m0 = make(mha_pools("page_first")[1], "page_first", disk, tp_rank=0, tp_size=2)
    m1 = make(mha_pools("page_first")[1], "page_first", disk, tp_rank=1, tp_size=2)
    assert all(m0.batch_set_v1(keys, m0.mem_pool_host.alloc(2 * PAGE)))
    assert m0.batch_exists(keys) == 2 and m1.batch_exists(keys) == 0
    for be in (r0, r1, m0, m1):
        be.close()


def test_bad_config_fails_the_attach_with_a_named_field() -> None:
    _, host = mha_pools("page_first")
    with pytest.raises(ConfigError, match="cpuu"):
        StorageBackendFactory.create_backend("dynamic", storage_config("page_first", {"cpuu": 1}), host)
    with pytest.raises(ConfigError, match="sglang.model_idd"):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config("page_first", {"sglang": {"model_idd": "x"}}), host)
    cfg = storage_config("page_first")
    cfg.should_split_heads = True
    with pytest.raises(ConfigError, match="tp_lcm_size"):
        StorageBackendFactory.create_backend("dynamic", cfg, host)


@pytest.mark.parametrize("tiers", ["disk", "cpu+disk"])
def test_requests_larger_than_a_buffer_batch_stream_through_reused_buffers(tmp_path: Path, tiers: str) -> None:
    """A request spanning several of the thread's buffer batches restores every page exactly
    (disk only: reused write buffers; cpu+disk write-through: fresh ones the queue keeps), and a
    page missing in a later batch ends the run there. (A cpu tier alone moves pages in place:
    test_cpu_tier_pages_restore_in_place_and_a_corrupt_one_is_refused.)"""
    _, host = mha_pools("page_head")
    disk = {"disk": {"enabled": True, "path": str(tmp_path)}}
    extra = {"cpu": {"enabled": False}, **disk} if tiers == "disk" else disk
    be = make(host, "page_head", extra)
    assert be._bufs is not None and be._store is not None
    be._bufs.per_batch = 3  # batches of 3 pages: 10 pages cross three batch boundaries
    keys = keys_for(list(range(7, 7 + 10 * PAGE)))
    src = host.alloc(10 * PAGE)
    fill_random(host, seed=5)
    ref = pages_of(host, src, PAGE)
    assert be.batch_set_v1(keys, src) == [True] * 10
    assert be._store.flush(10)
    if tiers == "cpu+disk":  # the disk copies must be the pages too (not a reused buffer's last bytes)
        be._store.tiers[0].delete(be_keys(be, keys))
    dst = host.alloc(10 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 10
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst, PAGE), ref))
    be._store.delete(be_keys(be, keys[7:8]))
    assert be.batch_get_v1(keys, host.alloc(10 * PAGE)) == [True] * 7 + [False] * 3
    be.close()


def test_cpu_tier_pages_restore_in_place_and_a_corrupt_one_is_refused(tmp_path: Path) -> None:
    """Pages the cpu tier holds are verified in its arena and copied once (arena.py); a page
    only a lower tier holds is read through the store; a corrupt arena chunk never lands."""
    from kvtier.chunk import HEADER_SIZE

    _, host = mha_pools("page_first")
    be = make(host, "page_first", {"disk": {"enabled": True, "path": str(tmp_path)}})
    keys = keys_for(list(range(4 * PAGE)))
    src = host.alloc(4 * PAGE)
    fill_random(host, seed=7)
    ref = pages_of(host, src, PAGE)
    assert all(be.batch_set_v1(keys, src))
    assert be._store is not None
    be._store.flush(30)
    cpu = be._store.tiers[0]
    xkeys = be_keys(be, keys)
    cpu.delete([xkeys[2]])                                   # page 2: disk only
    dst = host.alloc(4 * PAGE)
    assert be.batch_get_v1(keys, dst) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(pages_of(host, dst, PAGE), ref))
    slot, _ = cpu._map[xkeys[1]]                             # flip one payload byte in the arena
    cpu._arena[slot * cpu.slot_bytes + HEADER_SIZE + 5] ^= 0xFF
    host.kv_buffer.view(torch.uint8)[...] = 0
    assert be.batch_get_v1(keys, dst) == [True, False, False, False]
    pages = pages_of(host, dst, PAGE)
    assert torch.equal(pages[0], ref[0]) and not pages[1].view(torch.uint8).any()
    assert be.batch_exists(keys) == 1                        # refused chunk deleted everywhere
    be.close()

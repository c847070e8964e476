"""KVTierStorage under SGLang's real HiCacheController storage threads, with faults.

The controller is built as the scheduler builds it (``storage_backend="dynamic"`` + the
extra-config dict), on a one-process gloo group, so its backup thread calls ``batch_set_v1``,
its prefetch thread ``batch_exists`` (then MIN-reduces over the TP group) and its IO thread
``batch_get_v1``, concurrently. The scheduler's part (drain the hit queue, allocate host
buffers, queue the IO) is done here by hand, as ``unified_radix_cache`` does it. Host KV bytes
are written into the host pool directly: device<->host copies have no CPU kernel.
"""

from __future__ import annotations

import logging
import random
import tempfile
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from faulty_backend import LAST
from pools import BACKEND, mha_pools, pages_of
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE = 4
TIMEOUT = 30


@pytest.fixture(scope="module", autouse=True)
def one_process_group() -> Any:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp()}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    yield
    dist.destroy_process_group()


def controller(extra: dict[str, Any], layout: str = "page_first") -> tuple[HiCacheController, Any]:
    dev, host = mha_pools(layout, ratio=8.0)
    alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    cc = HiCacheController(alloc, host, PAGE, tp_group=dist.group.WORLD,
                           load_cache_event=threading.Event(), write_policy="write_through",
                           io_backend="direct", storage_backend="dynamic", prefetch_threshold=PAGE,
                           model_name="tiny", storage_backend_extra_config=extra)
    return cc, host


def backup(cc: HiCacheController, host: Any, tokens: list[int], seed: int) -> tuple[list[torch.Tensor], int]:
    src = host.alloc(len(tokens))
    for i in range(0, len(tokens), PAGE):  # distinct random K/V per page
        page = host.get_data_page(int(src[i]), flat=False)
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        page.copy_(torch.randn(page.shape, generator=gen).to(page.dtype))
    ref = pages_of(host, src, PAGE)
    cc.write_storage(src, tokens, hash_value=get_storage_hash_str(tokens, None, page_size=PAGE))
    op = cc.ack_backup_queue.get(timeout=TIMEOUT)
    host.free(src)
    return ref, op.completed_tokens


def prefetch(cc: HiCacheController, host: Any, rid: str, tokens: list[int]) -> tuple[int, list[torch.Tensor]]:
    """(hit tokens restored, the restored pages) — what the radix cache would insert."""
    cc.prefetch(rid, tokens)
    op = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
    if op.storage_hit_count == 0:
        return 0, []
    dst = cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
    op.host_indices = dst
    cc.prefetch_buffer.put(op)
    done = None
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=TIMEOUT)
        if ack.completed_tokens is not None and done is None:
            done = ack.completed_tokens
        if getattr(ack, "completed_req", False):
            break
    pages = pages_of(host, dst[: done or 0], PAGE) if done else []
    host.free(dst)
    return done or 0, pages


def test_backup_and_prefetch_threads_store_and_restore_exact_pages() -> None:
    cc, host = controller({**BACKEND})
    be = cc.storage_backend
    assert type(be).__name__ == "KVTierStorage"
    assert cc.page_set_func.__name__ == "_page_set_zero_copy"
    tokens = list(range(1000, 1000 + 5 * PAGE))
    ref, written = backup(cc, host, tokens, seed=1)
    assert written == 5 * PAGE
    hit, pages = prefetch(cc, host, "r1", tokens + [7, 7, 7])   # a partial page is never a hit
    assert hit == 5 * PAGE and all(torch.equal(a, b) for a, b in zip(pages, ref))
    assert prefetch(cc, host, "r2", list(range(5000, 5000 + 2 * PAGE)))[0] == 0
    store = be._store
    cc.detach_storage_backend()
    assert store.closed             # close on shutdown: the store flushed and closed


def test_injected_faults_never_escape_and_never_restore_a_wrong_page(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """SGLang's own fault injector (random failures and delays before every backend call) over
    kvtier's fault-injecting tier (misses, failed puts, corrupt bytes): every restored page is
    exactly the page backed up under those tokens; no exception reaches SGLang's threads."""
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.2")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    extra = {**BACKEND, "module_path": "faulty_backend", "class_name": "FaultyKVTierStorage",
             "faults": {"seed": 3, "miss_rate": 0.05, "put_fail_rate": 0.05, "corrupt_rate": 0.1}}
    cc, host = controller(extra, layout="page_head")
    assert type(cc.storage_backend).__name__ == "HiCacheStorageFailureInjector"
    caplog.set_level(logging.WARNING)
    rng = random.Random(0)
    refs: dict[tuple[int, ...], list[torch.Tensor]] = {}
    restored = 0
    for rnd in range(24):
        n_pages = rng.randint(1, 6)
        tokens = [rng.randrange(50_000) for _ in range(n_pages * PAGE)]
        key = tuple(tokens)
        refs[key], _ = backup(cc, host, tokens, seed=rnd)
        hit, pages = prefetch(cc, host, f"r{rnd}", tokens)
        assert hit % PAGE == 0 and hit <= len(tokens)
        for got, want in zip(pages, refs[key]):
            assert torch.equal(got, want), f"round {rnd}: a wrong page was restored"
        restored += hit // PAGE
    tier = LAST[-1].tier
    threads = [cc.prefetch_thread, cc.backup_thread]
    assert all(t.is_alive() for t in threads), "a storage thread died"
    assert sum(tier.injected.values()) > 0, "the kvtier tier injected no fault"
    assert restored > 0, "faults this light must still let some pages through"
    escaped = [r for r in caplog.records if r.exc_info and r.name.startswith("sglang")]
    assert escaped == [], [r.getMessage() for r in escaped]
    cc.detach_storage_backend()

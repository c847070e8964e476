"""KVTierStorage's read-ahead and write-behind (readahead.py, writebehind.py) on SGLang's real
host pool. With one page per batch and several batches read ahead, a page that is corrupt,
missing or whose read raises in a later batch ends the restore exactly there. The pages before
it are restored exactly, none after it is copied (read ahead or not), nothing reaches SGLang's
thread.

Runs in the SGLang venv only (started by tests/test_sglang.py).
"""

from __future__ import annotations

import errno
from array import array
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from fakes import FaultyTier
from kvtier_sglang import KVTierStorage
from kvtier_sglang.namespace import store_keys
from pools import fill_random, mha_pools, pages_of, storage_config
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvtier.store import TieredStore
from kvtier.tiers.base import Miss

PAGE = 4  # mha_pools' page size
PAGES = 9


class DeviceGoneBad(FaultyTier):
    """Reads of the keys in ``bad`` raise EIO (a tier's medium failing under a read-ahead)."""

    def __init__(self) -> None:
        super().__init__(capacity_bytes=1 << 26)
        self.bad: set[bytes] = set()

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        if self.bad.intersection(keys):
            raise OSError(errno.EIO, "device read failed")
        return super().get_into(keys, outs)


def empty_backend(tier: FaultyTier) -> tuple[Any, KVTierStorage, list[str]]:
    """A backend over ``tier`` alone, one page per batch and a ring of sets reading ahead and
    writing behind; returns (host pool, backend, the keys of ``PAGES`` pages)."""
    _, host = mha_pools("page_first")
    be = KVTierStorage(storage_config("page_first"), {}, store=TieredStore([tier]))
    be.register_mem_pool_host(host)
    assert be._bufs is not None
    be._bufs.per_batch = 1
    assert be._bufs.ring_sets >= 3, "the ring must read more than one batch ahead here"
    keys = get_storage_hash_str(RadixKey(array("q", range(PAGES * PAGE))), None, page_size=PAGE)
    assert isinstance(keys, list) and len(keys) == PAGES
    return host, be, keys


def backend(tier: FaultyTier) -> tuple[Any, KVTierStorage, list[str], list[torch.Tensor]]:
    """:func:`empty_backend` holding ``PAGES`` random pages; returns (host pool, backend,
    keys, the pages)."""
    host, be, keys = empty_backend(tier)
    src = host.alloc(PAGES * PAGE)
    fill_random(host, seed=11)
    ref = pages_of(host, src, PAGE)
    assert be.batch_set_v1(keys, src) == [True] * PAGES
    return host, be, keys, ref


def restore(host: Any, be: KVTierStorage, keys: list[str]) -> tuple[list[bool], list[torch.Tensor]]:
    dst = host.alloc(PAGES * PAGE)
    host.kv_buffer.view(torch.uint8)[...] = 0  # a page not restored must stay untouched (zeros)
    got = be.batch_get_v1(keys, dst)
    return got, pages_of(host, dst, PAGE)


@pytest.mark.parametrize("fault", ["corrupt", "miss", "raise"])
@pytest.mark.parametrize("at", [1, 4, 8])
def test_a_bad_page_in_a_later_batch_ends_the_restore_exactly_there(fault: str, at: int) -> None:
    tier = DeviceGoneBad()
    host, be, keys, ref = backend(tier)
    bad = store_keys(be.namespace, keys[at:at + 1])[0]
    if fault == "corrupt":
        tier.corrupt(bad)
    elif fault == "miss":
        tier.fail_gets(bad)
    else:
        tier.bad.add(bad)
    got, pages = restore(host, be, keys)
    assert got == [True] * at + [False] * (PAGES - at)
    for i in range(PAGES):
        if i < at:
            assert torch.equal(pages[i], ref[i]), f"page {i} restored wrong"
        else:
            assert not pages[i].view(torch.uint8).any(), f"page {i}, after the bad one, was copied"
    stats = be.kvtier_stats()
    assert stats.get("get_errors", 0) == (1 if fault == "raise" else 0)
    tier.heal()
    tier.bad.clear()
    again, pages = restore(host, be, keys)
    if fault == "corrupt":  # refused and deleted: the run ends there for good
        assert again == [True] * at + [False] * (PAGES - at)
    else:
        assert again == [True] * PAGES and all(torch.equal(a, b) for a, b in zip(pages, ref))
    be.close()
    assert be.batch_get_v1(keys, host.alloc(PAGES * PAGE)) == [False] * PAGES  # closed: no reads


def test_written_behind_a_refused_batch_the_others_land_intact_and_the_call_says_false() -> None:
    """Write-behind (writebehind.py) on the same ring: one page's store refused in a middle batch
    fails the call (SGLang backs it up again later), while every other page, stored from a
    buffer set the next batches were filled around, restores byte for byte."""
    tier = DeviceGoneBad()
    host, be, keys = empty_backend(tier)
    tier.fail_puts(store_keys(be.namespace, keys[5:6])[0])
    src = host.alloc(PAGES * PAGE)
    fill_random(host, seed=12)
    ref = pages_of(host, src, PAGE)
    assert be.batch_set_v1(keys, src) == [False] * PAGES
    assert be.kvtier_stats()["set_errors"] == 1
    tier.heal()
    assert be.batch_exists(keys) == 5
    got, pages = restore(host, be, keys)
    assert got == [True] * 5 + [False] * (PAGES - 5)  # the hole ends the prefix
    assert all(torch.equal(pages[i], ref[i]) for i in range(5))
    fill_random(host, seed=12)  # restore() zeroed the pool: the same pages in src again
    assert be.batch_set_v1(keys, src) == [True] * PAGES  # backed up again: the hole is filled
    got, pages = restore(host, be, keys)
    assert got == [True] * PAGES and all(torch.equal(a, b) for a, b in zip(pages, ref))
    be.close()

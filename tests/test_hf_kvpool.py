"""kvtier_hf's recycled K/V memory (connectors/kvtier_hf/kvpool.py): a slab is handed out again
only once no tensor or view of it is alive, the pool keeps at most ``keep`` slabs, a slab only
serves requests of half its size up to its size, and restores through a connector's pool give
the same bytes as with fresh memory while reusing it."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_hf import KVTierHF, namespace_for
from kvtier_hf.compat import layer_kv
from kvtier_hf.kvpool import KVPool
from kvtier_hf.random_llama import TEST_SPEC, build_random_llama, random_prompt

from kvtier.cache import PrefixCache
from kvtier.config import MiB
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier

SHAPE = (4, 1, 2, 1000, 16)  # layers, batch, heads, tokens, head_dim: as a restore's K or V


def test_a_slab_comes_back_only_when_every_view_of_it_is_gone() -> None:
    pool = KVPool()
    t = pool.tensor(SHAPE, torch.bfloat16)
    ptr = t.data_ptr()
    view = t[1, :, :, :10]  # what the cache keeps: a view of the tensor
    del t
    gc.collect()
    assert pool.free_slabs == 0, "a slab went back while a view of it was alive"
    again = pool.tensor(SHAPE, torch.bfloat16)
    assert again.data_ptr() != ptr and pool.reused == 0
    del view
    gc.collect()
    assert pool.free_slabs == 1
    third = pool.tensor(SHAPE, torch.bfloat16)
    assert third.data_ptr() == ptr and pool.reused == 1 and pool.free_slabs == 0


def test_live_tensors_never_share_memory() -> None:
    """Writes to one tensor never show in another taken while it is alive (with recycled
    slabs in the pool)."""
    pool = KVPool()
    warm = [pool.tensor(SHAPE, torch.int16) for _ in range(3)]
    del warm
    gc.collect()
    live = [pool.tensor(SHAPE, torch.int16) for _ in range(5)]
    for i, t in enumerate(live):
        t.fill_(i)
    for i, t in enumerate(live):
        assert bool((t == i).all())
    assert pool.reused == 3


def test_the_pool_keeps_at_most_keep_slabs() -> None:
    pool = KVPool(keep=2)
    taken = [pool.tensor(SHAPE, torch.uint8) for _ in range(5)]
    del taken
    gc.collect()
    assert pool.free_slabs == 2
    with pytest.raises(ValueError, match="keep"):
        KVPool(keep=-1)


def test_the_pool_holds_at_most_keep_bytes_of_idle_memory() -> None:
    nbytes = 128_000  # one SHAPE tensor of uint8
    pool = KVPool(keep=8, keep_bytes=2 * nbytes + 1)
    taken = [pool.tensor(SHAPE, torch.uint8) for _ in range(4)]
    del taken
    gc.collect()
    assert pool.free_slabs == 2
    big = pool.tensor((3 * nbytes,), torch.uint8)  # larger than the whole bound: never kept
    del big
    gc.collect()
    assert pool.free_slabs == 0  # the oldest went first, then the big one itself


def test_a_slab_given_back_under_the_pool_lock_is_dropped_not_waited_for() -> None:
    """A tensor can die inside a garbage collection while the pool's lock is held (by
    ``tensor`` on the same thread): giving its slab back must not wait for the lock."""
    pool = KVPool()
    t = pool.tensor(SHAPE, torch.uint8)
    with pool._lock:  # as when a collection runs inside _take
        del t
        gc.collect()  # would deadlock if the finalizer waited
    assert pool.free_slabs == 0
    u = pool.tensor(SHAPE, torch.uint8)
    del u
    gc.collect()
    assert pool.free_slabs == 1


@pytest.mark.parametrize("first, then, reused", [
    (1000, 1000, True), (1000, 600, True), (1000, 499, False), (1000, 1001, False), (0, 0, True)])
def test_a_slab_serves_half_its_size_up_to_its_size(first: int, then: int, reused: bool) -> None:
    pool = KVPool()
    t = pool.tensor((first,), torch.uint8)
    del t
    gc.collect()
    u = pool.tensor((then,), torch.uint8)
    assert u.shape == (then,) and (pool.reused == 1) is reused


def test_connector_restores_reuse_kv_memory_and_stay_exact() -> None:
    """Two restores in a row through one connector: the second one's K/V tensors lie in the
    memory the first one's used (dropped in between), and both are bit-exact."""
    model = build_random_llama(TEST_SPEC)
    with TieredStore([MemoryTier(64 * MiB)]) as store:
        hf = KVTierHF(model, PrefixCache(store, namespace_for(model, 16)))
        ids = random_prompt(9 * 16 + 3, TEST_SPEC.vocab_size, 5)
        with torch.inference_mode():
            full = model(torch.tensor([ids]), use_cache=True).past_key_values
        assert hf.save(ids, full) == 10
        for _ in range(2):
            got = hf.restore_prefix(ids)
            assert got.tokens == len(ids) - 1
            for layer in range(TEST_SPEC.num_layers):
                for a, b in zip(layer_kv(full, layer), layer_kv(got.cache, layer)):
                    assert torch.equal(a[:, :, : len(ids) - 1], b)
            del got, a, b  # b: a view of the last layer's V, which holds V's slab
            gc.collect()
        assert hf._kv_pool.reused == 2  # K and V of the second restore
        hf.close()

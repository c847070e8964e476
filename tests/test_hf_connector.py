"""kvtier_hf with a real transformers engine: a small random-weight Llama (no download).

What is proven: K/V round-trips bit-exactly; generation from a restored prefix gives the same
greedy tokens as transformers' own ``generate`` without kvtier; the check can fail (a flipped
token or wrong K/V changes the output); a chunk of another namespace, layout or dtype is never
served; a second process sharing the disk directory reuses the prefix.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from kvtier_hf import KVTierHF, namespace_for
from kvtier_hf.compat import ForwardKwargs, cache_layers, layer_kv
from kvtier_hf.kv import cache_from_chunks
from kvtier_hf.random_llama import TEST_SPEC, build_random_llama, random_prompt

from kvtier.cache import PrefixCache
from kvtier.chunk import encode_chunk
from kvtier.config import CpuTierConfig, DiskTierConfig, KVTierConfig, MiB
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry
from kvtier.tiers.memory import MemoryTier

CHUNK = 16
NEW = 12


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_random_llama(TEST_SPEC)


@pytest.fixture
def store() -> TieredStore:
    s = TieredStore([MemoryTier(64 * MiB)])
    yield s
    s.close()


def _hf(model: torch.nn.Module, store: TieredStore, chunk: int = CHUNK) -> KVTierHF:
    return KVTierHF(model, PrefixCache(store, namespace_for(model, chunk)))


def _prompt(n: int, seed: int = 1) -> list[int]:
    return random_prompt(n, TEST_SPEC.vocab_size, seed)


def _hf_generate(model: torch.nn.Module, ids: list[int]) -> list[int]:
    """transformers' own greedy generate: the baseline kvtier is compared with."""
    x = torch.tensor([ids])
    # An explicit mask: without it generate() masks every token equal to pad_token_id.
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


def _full_forward(model: torch.nn.Module, ids: list[int]) -> tuple[object, torch.Tensor]:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values, out.logits[0, -1].float()


def test_forward_kwargs_follow_the_signature(model: torch.nn.Module) -> None:
    assert ForwardKwargs.of(model).cache == "past_key_values"

    class Renamed(torch.nn.Module):  # a release that calls the keyword ``cache``
        def forward(self, input_ids=None, cache=None, position_ids=None):  # type: ignore[no-untyped-def]
            return None

    kw = ForwardKwargs.of(Renamed())
    assert (kw.cache, kw.cache_position, kw.logits_to_keep) == ("cache", False, None)
    assert set(kw.build(torch.tensor([[1, 2]]), "C", 5)) == {"input_ids", "cache", "position_ids", "use_cache"}


def test_namespace_from_model(model: torch.nn.Module) -> None:
    spec = namespace_for(model, CHUNK)
    assert spec.model_id == TEST_SPEC.model_id and spec.model_revision.startswith("w")
    assert spec.kv_dtype == "float32"
    assert spec.layout == KVLayout(TEST_SPEC.num_layers, TEST_SPEC.num_kv_heads, TEST_SPEC.head_dim, CHUNK)


def test_store_load_round_trip_is_bit_exact(model: torch.nn.Module, store: TieredStore) -> None:
    hf = _hf(model, store)
    ids = _prompt(70)  # 4 full chunks + a partial one of 6 tokens
    cache, _ = _full_forward(model, ids)
    assert hf.save(ids, cache) == 5
    loaded = hf.prefix_cache.load(ids)
    assert loaded.tokens == 70 and len(loaded.payloads) == 5
    back = cache_from_chunks(loaded.payloads, loaded.shapes, 70, hf.spec.layout, torch.float32, model.config)
    assert cache_layers(back) == TEST_SPEC.num_layers
    for layer in range(TEST_SPEC.num_layers):
        for a, b in zip(layer_kv(cache, layer), layer_kv(back, layer)):
            assert torch.equal(a, b)
    # restore() leaves the last prompt token to prefill: the partial chunk is sliced.
    restored, n = hf.restore(ids)
    assert n == 69
    for layer in range(TEST_SPEC.num_layers):
        for a, b in zip(layer_kv(cache, layer), layer_kv(restored, layer)):
            assert torch.equal(a[:, :, :69], b)
    assert hf.save(ids, cache) == 0  # everything is cached already


@pytest.mark.parametrize("gap", [None, 1, 3, 6])
def test_pipelined_restore_stops_at_a_chunk_gone_after_lookup(model: torch.nn.Module, store: TieredStore,
                                                              monkeypatch: pytest.MonkeyPatch, gap: int | None) -> None:
    """One chunk per read batch, several reads in flight: every byte before a chunk deleted
    between lookup and load is restored exactly, nothing after it, and the reads already in
    flight past the gap are dropped."""
    import kvtier_hf.restore as restore_mod

    monkeypatch.setattr(restore_mod, "BATCH_BYTES", 1)  # one chunk per batch
    hf = _hf(model, store)
    ids = _prompt(8 * CHUNK + 5)
    cache, _ = _full_forward(model, ids)
    assert hf.save(ids, cache) == 9
    hit = hf.prefix_cache.lookup(ids)
    if gap is not None:
        store.delete(hf.prefix_cache.keys(ids)[gap:gap + 1])
    got = restore_mod.restore(hf.prefix_cache, np.asarray(ids), hit.tokens, len(ids) - 1, torch.float32,
                              model.config)
    want = len(ids) - 1 if gap is None else gap * CHUNK
    assert got.tokens == want
    assert got.reason == "absent"  # the deleted chunk's reason; ABSENT (no reason) for a whole restore
    for layer in range(TEST_SPEC.num_layers):
        for a, b in zip(layer_kv(cache, layer), layer_kv(got.cache, layer)):
            assert torch.equal(a[:, :, :want], b)


@pytest.mark.parametrize("sets", [2, 3, 8])
def test_restore_reuses_a_connector_ring_and_keeps_bytes_exact(model: torch.nn.Module, store: TieredStore,
                                                               sets: int) -> None:
    """One staging ring, one chunk per batch, far fewer sets than batches, two restores in a
    row: every set is reused many times while reads run ahead, and the bytes stay exact (a
    read let into a set whose copy is not done would restore another chunk's K/V)."""
    import kvtier_hf.restore as restore_mod
    from kvtier_hf.staging import StagingRing

    hf = _hf(model, store)
    ids = _prompt(12 * CHUNK + 5)
    cache, _ = _full_forward(model, ids)
    assert hf.save(ids, cache) == 13
    ring = StagingRing(restore_mod.buffer_bytes(hf.prefix_cache), 1, sets)
    hit = hf.prefix_cache.lookup(ids)
    for _ in range(2):
        got = restore_mod.restore(hf.prefix_cache, np.asarray(ids), hit.tokens, len(ids) - 1, torch.float32,
                                  model.config, staging=ring)
        assert got.tokens == len(ids) - 1
        for layer in range(TEST_SPEC.num_layers):
            for a, b in zip(layer_kv(cache, layer), layer_kv(got.cache, layer)):
                assert torch.equal(a[:, :, :len(ids) - 1], b)


@pytest.mark.parametrize("sets", [2, 3])
def test_restore_promotes_every_chunk_before_its_staging_set_is_reused(model: torch.nn.Module,
                                                                       sets: int) -> None:
    """Chunks read from the lower tier are promoted off the readers (deferred, by the copier
    thread): the top tier must end up with each chunk's own bytes, which it would not if a
    set were read into again before the promotion out of it finished."""
    import kvtier_hf.restore as restore_mod
    from kvtier_hf.staging import StagingRing

    top, lower = MemoryTier(64 * MiB, name="top"), MemoryTier(64 * MiB, name="lower")
    with TieredStore([top, lower]) as two:
        hf = _hf(model, two)
        ids = _prompt(12 * CHUNK + 5)
        cache, _ = _full_forward(model, ids)
        assert hf.save(ids, cache) == 13
        two.flush(10)
        keys = hf.prefix_cache.keys(ids)
        top.delete(keys)
        ring = StagingRing(restore_mod.buffer_bytes(hf.prefix_cache), 1, sets)
        got = restore_mod.restore(hf.prefix_cache, np.asarray(ids), len(ids), len(ids) - 1, torch.float32,
                                  model.config, staging=ring)
        assert got.tokens == len(ids) - 1 and got.per_tier == {"lower": 13}
        assert top.get(keys) == lower.get(keys)


def test_restored_generation_matches_transformers(model: torch.nn.Module, store: TieredStore) -> None:
    hf = _hf(model, store)
    ids = _prompt(100)
    expected = _hf_generate(model, ids)
    _, ref_logits = _full_forward(model, ids)
    cold = hf.generate(ids, NEW)
    assert (cold.restored_tokens, cold.saved_chunks) == (0, 7)
    warm = hf.generate(ids, NEW)
    assert warm.restored_tokens == 99 and warm.prefilled_tokens == 1
    assert warm.hits_per_tier == {"memory": 7}
    assert list(cold.tokens) == expected and list(warm.tokens) == expected
    torch.testing.assert_close(warm.first_logits, ref_logits, rtol=1e-4, atol=1e-4)
    # Same prefix, another question: the full shared chunks are reused.
    other = ids[:80] + _prompt(25, seed=9)
    res = hf.generate(other, NEW)
    assert res.restored_tokens == 80 and res.hits_per_tier == {"memory": 5}
    assert list(res.tokens) == _hf_generate(model, other)


def test_control_equality_can_fail(model: torch.nn.Module, store: TieredStore) -> None:
    hf = _hf(model, store)
    ids = _prompt(100)
    original = hf.generate(ids, NEW)
    flipped = list(ids)
    flipped[3] = (flipped[3] + 1) % TEST_SPEC.vocab_size
    # A changed early token changes the output (so matching outputs are evidence) ...
    res = hf.generate(flipped, NEW)
    assert res.restored_tokens == 0  # ... and it invalidates every chunk after it.
    assert list(res.tokens) == _hf_generate(model, flipped)
    assert res.tokens != original.tokens
    # Wrong K/V (the original prefix's) under the flipped prompt gives a different output than
    # the correct one: a connector restoring wrong bytes would fail the tests above.
    wrong_cache, n = hf.restore(ids)
    assert n == 99
    with torch.inference_mode():
        kwargs = ForwardKwargs.of(model).build(torch.tensor([flipped[n:]]), wrong_cache, n)
        wrong_logits = model(**kwargs).logits[0, -1].float()
    assert not torch.allclose(wrong_logits, res.first_logits, atol=1e-3)


def test_other_namespace_layout_or_dtype_is_a_miss(model: torch.nn.Module, store: TieredStore) -> None:
    ids = _prompt(64)
    _hf(model, store).generate(ids, 2)
    # Another chunk size (layout) over the same store: another namespace, nothing served.
    assert _hf(model, store, chunk=32).restore(ids)[1] == 0
    # The same weights in bfloat16: another KV dtype, another namespace.
    bf16 = build_random_llama(TEST_SPEC).to(torch.bfloat16)
    hf_bf16 = KVTierHF(bf16, PrefixCache(store, namespace_for(bf16, CHUNK, revision=model.kvtier_revision)))
    assert hf_bf16.spec.kv_dtype == "bfloat16"
    assert hf_bf16.restore(ids)[1] == 0
    # A PrefixCache bound to a layout this model does not have is refused outright.
    wrong = NamespaceSpec(TEST_SPEC.model_id, KVLayout(3, TEST_SPEC.num_kv_heads, TEST_SPEC.head_dim, CHUNK),
                          kv_dtype="float32")
    with pytest.raises(ValueError, match="does not match"):
        KVTierHF(model, PrefixCache(store, wrong))


@pytest.mark.parametrize("forge", ["shape", "dtype"])
def test_forged_chunk_with_the_right_key_is_refused(model: torch.nn.Module, store: TieredStore,
                                                    forge: str) -> None:
    hf = _hf(model, store)
    ids = _prompt(48)
    key0 = hf.prefix_cache.keys(ids)[0]
    lay = hf.spec.layout
    if forge == "shape":  # one KV head too many, float32 as expected
        shape, dtype = (lay.num_layers, 2, CHUNK, lay.num_kv_heads + 1, lay.head_dim), "float32"
        payload = torch.zeros(shape).numpy().tobytes()
    else:  # right shape, bfloat16 bytes
        shape, dtype = lay.chunk_shape(CHUNK), "bfloat16"
        payload = torch.zeros(shape, dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    forged = encode_chunk(hf.prefix_cache.namespace, key0, dtype, shape, payload)
    assert store.tiers[0].put([Entry(key0, forged)]) == [True]
    assert hf.prefix_cache.lookup(ids).tokens > 0  # the index says "hit" ...
    res = hf.generate(ids, NEW)
    assert res.restored_tokens == 0 and res.miss_reason == "layout_mismatch"  # ... the load refuses
    assert list(res.tokens) == _hf_generate(model, ids)
    registry = hf.prefix_cache.metrics.registry
    assert registry.get_sample_value("kvtier_chunk_errors_total", {"reason": "layout_mismatch"}) == 1


def test_bad_inputs(model: torch.nn.Module, store: TieredStore) -> None:
    hf = _hf(model, store)
    assert hf.restore([5])[1] == 0  # one token: nothing may be restored
    with pytest.raises(ValueError, match="batch 1"):
        hf.generate(torch.zeros((2, 8), dtype=torch.long), 2)
    with pytest.raises(ValueError):
        hf.generate([], 2)
    vocab = TEST_SPEC.vocab_size
    for bad in (vocab, -1):  # named, before any lookup, restore or save
        ids = [*_prompt(2 * CHUNK), bad]
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary"):
            hf.generate(ids, 2)
        with pytest.raises(ValueError, match=f"token id {bad} is outside the model's vocabulary"):
            hf.restore(ids)
    assert store.tiers[0].usage().entries == 0


_SECOND_PROCESS = textwrap.dedent("""
    import json, sys
    from kvtier.config import KVTierConfig
    from kvtier_hf import KVTierHF
    from kvtier_hf.random_llama import TEST_SPEC, build_random_llama, random_prompt
    cfg = KVTierConfig.from_dict(json.loads(sys.argv[1]))
    ids = random_prompt(int(sys.argv[2]), TEST_SPEC.vocab_size, 7)
    with KVTierHF(build_random_llama(TEST_SPEC), cfg) as hf:
        res = hf.generate(ids, int(sys.argv[3]))
    print(json.dumps({"restored": res.restored_tokens, "tiers": res.hits_per_tier,
                      "tokens": list(res.tokens)}))
""")


def test_second_process_reuses_prefix_from_shared_disk(model: torch.nn.Module, tmp_path: Path) -> None:
    conf = {"chunk_tokens": CHUNK, "cpu": {"capacity_bytes": 8 * MiB, "slot_bytes": 64 * 1024},
            "disk": {"enabled": True, "path": str(tmp_path / "disk"), "capacity_bytes": 64 * MiB}}
    cfg = KVTierConfig.from_dict(conf)
    assert cfg.cpu == CpuTierConfig(capacity_bytes=8 * MiB, slot_bytes=64 * 1024)
    assert isinstance(cfg.disk, DiskTierConfig) and cfg.disk.enabled
    ids = random_prompt(90, TEST_SPEC.vocab_size, 7)
    with KVTierHF(model, cfg) as hf:
        first = hf.generate(ids, NEW)
    assert first.restored_tokens == 0 and first.saved_chunks == 6
    proc = subprocess.run([sys.executable, "-c", _SECOND_PROCESS, json.dumps(conf), "90", str(NEW)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    assert second["restored"] == 89 and second["tiers"] == {"disk": 6}
    assert second["tokens"] == list(first.tokens) == _hf_generate(model, ids)


def test_restored_kv_lands_on_each_layer_own_device(model: torch.nn.Module, store: TieredStore) -> None:
    """A model split over devices (``device_map``) attends layer i where its weights are, and
    the cache's next update concatenates onto the restored K/V there: each layer's K/V go to
    its attention's device (they all went to the first parameter's, and transformers then
    failed on mixed devices). Under accelerate, a layer runs on its hook's
    ``execution_device`` and an offloaded one keeps its weights on ``meta``: never a place
    for K/V. A CPU machine has one real device, so the device a hook names here is ``meta``
    (what only the hook can have said), and the offloaded layer without a hook must land on
    the model's device, not on ``meta``."""
    ids = _prompt(70)
    cache, _ = _full_forward(model, ids)
    assert _hf(model, store).save(ids, cache) == 5
    split = build_random_llama(TEST_SPEC)
    split.model.layers[0].self_attn.to("meta")  # weights offloaded, no hook: the model's device
    split.model.layers[1]._hf_hook = types.SimpleNamespace(execution_device="meta")  # accelerate's
    hf = KVTierHF(split, PrefixCache(store, namespace_for(model, CHUNK)))
    got = hf.restore_prefix(ids)
    assert got.tokens == 69
    devices = [k.device.type for k, _ in (layer_kv(got.cache, i) for i in range(TEST_SPEC.num_layers))]
    assert devices == ["cpu", "meta"] + ["cpu"] * (TEST_SPEC.num_layers - 2), devices
    k0, _ = layer_kv(got.cache, 0)
    assert torch.equal(k0, layer_kv(cache, 0)[0][:, :, :69])  # the other layers' bytes as saved

"""The ``key_schema`` option: v1 (token chain per chunk) or x1 (SGLang's page chain per page).

With x1 every connector that holds tokens (kvtier_hf, kvtier_vllm, through ``PrefixCache``)
writes and reads the keys SGLang's backend computes from its own page hashes
(tests/vectors/keys_x1.json), and page size, chunk size and block size must agree (ConfigError
naming the field otherwise). Real cpu tier, real model (kvtier_hf's seeded random Llama).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from kvtier.cache import PrefixCache
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import KVLayout, NamespaceSpec, chunk_keys, page_hash_seed, xengine_keys
from kvtier.store import TieredStore

VECTORS = json.loads((Path(__file__).parent / "vectors" / "keys_x1.json").read_text())


def spec_of(case: dict[str, Any]) -> NamespaceSpec:
    return NamespaceSpec(model_id=case["model_id"], layout=KVLayout(**case["layout"]),
                         kv_dtype=case["kv_dtype"], model_revision=case["model_revision"],
                         rank=case["rank"], world_size=case["world_size"],
                         salt=bytes.fromhex(case["salt_hex"]))


def cpu_store() -> TieredStore:
    return TieredStore.from_config(KVTierConfig.from_dict({"cpu": {"capacity_bytes": "64MiB"}}))


def test_config_key_schema_is_validated() -> None:
    assert KVTierConfig().key_schema == "v1"
    assert KVTierConfig.from_dict({"key_schema": "x1"}).key_schema == "x1"
    with pytest.raises(ConfigError, match="key_schema"):
        KVTierConfig.from_dict({"key_schema": "x2"})
    with pytest.raises(ConfigError, match="hash"):
        KVTierConfig.from_dict({"key_schema": "x1", "hash": "xxh3_128"})


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: f"{c['model_id']}-{c['cache_salt']}")
def test_prefix_cache_x1_keys_are_the_pinned_vectors(case: dict[str, Any]) -> None:
    seed = page_hash_seed(case["extra_key"], case["cache_salt"])
    cache = PrefixCache(cpu_store(), spec_of(case), key_schema="x1", page_seed=seed)
    try:
        assert cache.namespace.hex() == case["namespace_hex"]
        assert [k.hex() for k in cache.keys(case["tokens"])] == case["keys_hex"]
        # x1 keys full pages only, whatever the caller asks for.
        assert cache.keys(case["tokens"], full_chunks_only=True) == cache.keys(case["tokens"])
        page = case["layout"]["chunk_tokens"]
        assert cache.spans(len(case["tokens"])) == [(i * page, (i + 1) * page)
                                                    for i in range(len(case["keys_hex"]))]
    finally:
        cache.close()


def test_x1_save_lookup_load_full_pages_and_never_meets_v1() -> None:
    spec = NamespaceSpec("m", KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, chunk_tokens=8))
    store = cpu_store()
    x1 = PrefixCache(store, spec, key_schema="x1")
    v1 = PrefixCache(store, spec)
    tokens = np.arange(3 * 8 + 5, dtype=np.uint32) * 7 + 3
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, 2, len(tokens), 2, 4)).astype(np.float16)
    try:
        assert x1.save(tokens, lambda s, e: kv[:, :, s:e].tobytes()) == 3  # the partial page: never
        assert store.lookup(xengine_keys(x1.namespace, tokens, 8)).hits == 3
        hit = x1.lookup(tokens)
        assert (hit.tokens, hit.chunks) == (24, 3)
        got = x1.load(tokens)
        assert got.tokens == 24
        for i, payload in enumerate(got.payloads):
            assert bytes(payload) == kv[:, :, 8 * i:8 * (i + 1)].tobytes()
        assert v1.lookup(tokens).tokens == 0                 # other schema: other keys
        seeded = PrefixCache(store, spec, key_schema="x1", page_seed=page_hash_seed(None, "t"))
        assert seeded.lookup(tokens).tokens == 0             # another tenant's chain
        assert not set(x1.keys(tokens)) & set(chunk_keys(x1.namespace, tokens, 8))
    finally:
        store.close()


def test_prefix_cache_refuses_bad_schema_hash_and_seed() -> None:
    spec = NamespaceSpec("m", KVLayout(1, 1, 4, chunk_tokens=4))
    store = cpu_store()
    try:
        with pytest.raises(ConfigError, match="key_schema"):
            PrefixCache(store, spec, key_schema="v2")
        with pytest.raises(ConfigError, match="hash"):
            PrefixCache(store, NamespaceSpec("m", spec.layout, hash_name="xxh3_128"), key_schema="x1")
        with pytest.raises(ConfigError, match="page_seed"):
            PrefixCache(store, spec, page_seed=b"\0" * 32)           # a seed means x1
        with pytest.raises(ConfigError, match="page_seed"):
            PrefixCache(store, spec, key_schema="x1", page_seed=b"short")
    finally:
        store.close()


def test_vllm_x1_request_salt_is_sglang_page_seed() -> None:
    from kvtier_vllm.settings import check_block_size, namespace_salt

    x1 = KVTierConfig.from_dict({"key_schema": "x1", "salt_hex": "aa", "chunk_tokens": 256})
    assert namespace_salt(x1, "tenant-a") == page_hash_seed(None, "tenant-a")
    assert namespace_salt(x1, None) == b""                  # shared chain, namespace salt = salt_hex
    assert namespace_salt(KVTierConfig(), "tenant-a") == b"tenant-a"  # v1 unchanged
    check_block_size(x1, 128)                               # a page of two 128-token blocks
    with pytest.raises(ConfigError, match="chunk_tokens"):
        check_block_size(KVTierConfig.from_dict({"key_schema": "x1", "chunk_tokens": 64}), 128)


def test_sglang_x1_refuses_a_page_size_other_than_chunk_tokens() -> None:
    from kvtier_sglang.namespace import namespace_spec
    from kvtier_sglang.pages import PageGeometry
    from kvtier_sglang.settings import SglangSettings

    geo = PageGeometry(layout="page_first", is_mla=False, layers=2, heads=2, head_dim=8,
                       page_tokens=64, dtype=torch.bfloat16)
    sc = SimpleNamespace(model_name="m", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    x1 = KVTierConfig.from_dict({"key_schema": "x1", "chunk_tokens": 128})
    with pytest.raises(ConfigError, match="chunk_tokens.*--page-size 64"):
        namespace_spec(sc, geo, x1, SglangSettings())
    ok = namespace_spec(sc, geo, KVTierConfig.from_dict({"key_schema": "x1", "chunk_tokens": 64}),
                        SglangSettings())
    assert ok.layout.chunk_tokens == 64
    # v1 (the default): chunk_tokens does not apply to SGLang, the page size names the namespace.
    assert namespace_spec(sc, geo, KVTierConfig(), SglangSettings()).layout.chunk_tokens == 64


def test_transformers_connector_writes_and_restores_x1_pages(tmp_path: Path) -> None:
    from kvtier_hf.connector import KVTierHF
    from kvtier_hf.random_llama import TEST_SPEC, build_random_llama, random_prompt

    model = build_random_llama(TEST_SPEC)
    cfg = KVTierConfig.from_dict({"key_schema": "x1", "chunk_tokens": 8,
                                  "cpu": {"enabled": False},
                                  "disk": {"enabled": True, "path": str(tmp_path)}})
    prompt = random_prompt(4 * 8 + 3, TEST_SPEC.vocab_size, seed=5)
    with KVTierHF(model, cfg, model_id="x1-test") as hf:
        cold = hf.generate(prompt, 4)
        assert cold.saved_chunks == 4                           # full pages only
        assert hf.flush(30)
        keys = xengine_keys(hf.prefix_cache.namespace, prompt, 8)
        assert hf.prefix_cache.store.lookup(keys).hits == 4    # the keys SGLang computes
        base = hf.generate(prompt, 4, use_kvtier=False)
    with KVTierHF(model, cfg, model_id="x1-test") as hf:        # a fresh process's view
        warm = hf.generate(prompt, 4)
    assert warm.restored_tokens == 32
    assert warm.tokens == base.tokens == cold.tokens
    assert float((warm.first_logits - base.first_logits).abs().max()) < 1e-4

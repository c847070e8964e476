"""The SGLang backend's attach-time decisions that need no SGLang (the checks on SGLang's real
classes are tests/sglang_checks/check_attach.py and check_placement.py): the weights revision,
cpu-tier slot sizing, MLA rank sharing and the prefix a kvtier-server cluster places pages by."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvtier_sglang import namespace, prefix
from kvtier_sglang.namespace import check_rank_sharing, fit_slots, page_hash_bytes, weights_revision
from kvtier_sglang.pages import PageGeometry
from kvtier_sglang.prefix import PagePrefix, PrefixKeys, grouped_cluster
from kvtier_sglang.served import ServedModel
from kvtier_sglang.settings import SglangSettings, load_settings, slot_bytes_named

from kvtier.checkpoint import checkpoint_revision
from kvtier.chunk import HEADER_SIZE
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import xengine_key
from kvtier.tiers.remote.placement import Ring, place

GEO = PageGeometry(layout="page_first", is_mla=False, layers=4, heads=2, head_dim=64, page_tokens=1,
                   dtype=torch.bfloat16)  # 2048-byte pages


def ckpt(root: Path, name: str, weights: bytes) -> str:
    path = root / name
    path.mkdir()
    (path / "model.bin").write_bytes(weights * 4096)
    return str(path)


def test_revision_names_the_loaded_checkpoint_not_the_served_name(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = ckpt(tmp_path, "A", b"\x01"), ckpt(tmp_path, "B", b"\x02")
    served = SimpleNamespace(model_name="assistant")  # --served-model-name: no checkpoint in it
    monkeypatch.setattr(namespace, "served_model", lambda: ServedModel(a, None))
    rev_a = weights_revision(served, SglangSettings())
    monkeypatch.setattr(namespace, "served_model", lambda: ServedModel(b, None))
    assert rev_a == checkpoint_revision(a) != weights_revision(served, SglangSettings()) == checkpoint_revision(b)
    assert weights_revision(served, SglangSettings(model_revision="v7")) == "v7"  # named: wins
    monkeypatch.setattr(namespace, "served_model", lambda: ServedModel("org/not-cached", "v2"))
    assert weights_revision(served, SglangSettings()) == "v2"
    monkeypatch.setattr(namespace, "served_model", lambda: None)  # nothing published: model_name
    assert weights_revision(SimpleNamespace(model_name=a), SglangSettings()) == rev_a


def test_slot_bytes_named_sees_every_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVTIER_CPU__SLOT_BYTES", raising=False)
    assert not slot_bytes_named(None) and not slot_bytes_named({"cpu": {"capacity_bytes": "1GiB"}})
    assert slot_bytes_named({"cpu": {"slot_bytes": "4MiB"}})  # the default's value, but chosen
    yaml = tmp_path / "kvtier.yaml"
    yaml.write_text("cpu:\n  slot_bytes: 8KiB\n")
    assert slot_bytes_named({"config_file": str(yaml)})
    monkeypatch.setenv("KVTIER_CPU__SLOT_BYTES", "8KiB")
    assert slot_bytes_named({})
    assert load_settings({})[0].cpu.slot_bytes == 8192


def test_fit_slots_sizes_unset_slots_to_one_page(caplog: pytest.LogCaptureFixture) -> None:
    chunk = HEADER_SIZE + GEO.page_bytes
    cfg = KVTierConfig()
    assert fit_slots(cfg, GEO, slot_named=False).cpu.slot_bytes == 4096 == -(-chunk // 4096) * 4096
    big = PageGeometry(layout="page_first", is_mla=False, layers=64, heads=8, head_dim=128, page_tokens=64,
                       dtype=torch.bfloat16)  # 16 MiB pages: grown, capacity too if needed
    grown = fit_slots(KVTierConfig.from_dict({"cpu": {"capacity_bytes": "8MiB"}}), big, slot_named=False)
    assert grown.cpu.slot_bytes == (16 << 20) + 4096 == grown.cpu.capacity_bytes
    caplog.set_level(logging.WARNING)
    chosen = KVTierConfig.from_dict({"cpu": {"slot_bytes": "64KiB"}})
    assert fit_slots(chosen, GEO, slot_named=True).cpu.slot_bytes == 64 << 10
    assert "cpu.slot_bytes" in caplog.text and "96% of each unused" in caplog.text
    caplog.clear()
    snug = KVTierConfig.from_dict({"cpu": {"slot_bytes": 4096}})
    assert fit_slots(snug, GEO, slot_named=True).cpu.slot_bytes == 4096 and not caplog.text
    small = KVTierConfig.from_dict({"cpu": {"slot_bytes": 4096}})
    assert fit_slots(small, big, slot_named=True).cpu.slot_bytes == (16 << 20) + 4096  # raised
    off = KVTierConfig.from_dict({"cpu": {"enabled": False}})
    assert fit_slots(off, GEO, slot_named=False) is off


def test_mla_across_tp_ranks_needs_a_shared_tier(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    mla2 = SimpleNamespace(is_mla_model=True, tp_size=2)
    with pytest.raises(ConfigError, match=r"disk.enabled / redis.enabled / grpc.enabled.*tp_size 2"):
        check_rank_sharing(mla2, KVTierConfig())
    check_rank_sharing(SimpleNamespace(is_mla_model=True, tp_size=1), KVTierConfig())
    check_rank_sharing(SimpleNamespace(is_mla_model=False, tp_size=8), KVTierConfig())  # own heads
    disk = KVTierConfig.from_dict({"disk": {"enabled": True, "path": "/nvme/kv"}})
    check_rank_sharing(mla2, disk)
    monkeypatch.setattr(namespace, "served_nnodes", lambda: 2)  # ranks on two hosts: warned
    caplog.set_level(logging.WARNING)
    check_rank_sharing(mla2, disk)
    assert "/nvme/kv is a filesystem every host shares" in caplog.text
    caplog.clear()
    check_rank_sharing(mla2, KVTierConfig.from_dict({"redis": {"enabled": True}}))
    assert not caplog.text


def test_page_prefix_is_the_chain_and_places_as_the_whole_prefix() -> None:
    ns = bytes(range(32))
    hashes = [f"{i:064x}" for i in range(1, 41)]
    chain = [xengine_key(ns, page_hash_bytes(h)) for h in hashes]
    p = PagePrefix(ns, hashes[:30], chain[30:])
    assert len(p) == 40 and list(p) == chain and p[-1] == chain[-1] and p[3:9] == chain[3:9]
    assert p.index(chain[33]) == 33 and p.index(chain[4]) == 4
    with pytest.raises(ValueError):
        p.index(b"\0" * 32)
    with pytest.raises(IndexError):
        p[40]
    lazy = PagePrefix(ns, hashes[:30], chain[30:])
    ring = Ring([f"n{i}:1" for i in range(5)])
    assert place(ring, chain[30:], lazy, 8, 2) == place(ring, chain[30:], chain, 8, 2)
    assert sorted(lazy._computed) == [24]  # one head key hashed: the group anchor of depth 30


def test_prefix_keys_from_sglangs_extra_info(caplog: pytest.LogCaptureFixture) -> None:
    cluster = KVTierConfig.from_dict({"grpc": {"enabled": True, "nodes": ["a:1", "b:1"]}})
    assert grouped_cluster(cluster)
    assert not grouped_cluster(KVTierConfig.from_dict({"grpc": {"enabled": True, "nodes": ["a:1"]}}))
    assert not grouped_cluster(KVTierConfig.from_dict(
        {"grpc": {"enabled": True, "nodes": ["a:1", "b:1"], "group_chunks": 1}}))
    ns, keys = bytes(32), [bytes([i]) * 32 for i in range(3)]
    caplog.set_level(logging.WARNING)
    on = PrefixKeys(SimpleNamespace(extra_config={prefix.PASS_PREFIX_KEYS: True}), cluster)
    assert not caplog.text
    assert list(on.of(ns, SimpleNamespace(prefix_keys=None), keys) or []) == keys  # depth 0
    assert on.of(ns, None, keys) is None                                           # nothing said
    deep = on.of(ns, SimpleNamespace(prefix_keys=["ab" * 32]), keys)
    assert deep is not None and len(deep) == 4 and deep[1:] == keys
    off = PrefixKeys(SimpleNamespace(extra_config={prefix.PASS_PREFIX_KEYS: False}), cluster)
    assert "hicache_storage_pass_prefix_keys is off" in caplog.text and "2 nodes" in caplog.text
    assert off.of(ns, SimpleNamespace(prefix_keys=None), keys) is None
    assert off.of(ns, SimpleNamespace(prefix_keys=[]), keys) is not None  # a list proves it on
    assert list(off.of(ns, SimpleNamespace(prefix_keys=None), keys) or []) == keys

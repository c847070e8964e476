"""What besides token ids names a vLLM request's chunks (settings.request_salt), with real
``vllm.v1.request.Request`` objects and the real scheduler and worker halves.

vLLM's own block hashes cover the LoRA adapter, multimodal inputs and prompt embeddings; an
audit found kvtier's keys covered token ids and cache_salt only, so a request under adapter B,
or with other prompt embeddings (whose token ids vLLM sets to 0), hit adapter A's KV.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

C = 32


def _request(rid: str, tokens: list[int] | None, **kw: Any) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=4), None, **kw)


def _save(sched: Any, worker: Any, caches: dict[str, torch.Tensor], r: Any, blocks: list[int]) -> int:
    """Run ``r``'s prefill with random KV; the number of chunk saves it planned."""
    from tests.test_vllm_connector_flow import _fill, _run_step
    from tests.vllm_halves import scheduler_output

    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    meta, _, _ = _run_step(sched, worker, scheduler_output([(r, blocks, 0)], {r.request_id: r.num_tokens}),
                           caches, _fill(blocks, 5))
    time.sleep(0.2)
    sched.request_finished(r)
    return len(meta.saves)


def test_lora_adapters_and_prompt_embeddings_never_share_chunks(tmp_path: Path) -> None:
    from vllm.lora.request import LoRARequest

    from tests.test_vllm_connector_flow import _halves

    sched, worker, caches = _halves(tmp_path, async_load="never", load_decision="always")
    try:
        tokens = list(range(7, 7 + 4 * C + 5))
        a = LoRARequest("adapter-a", 1, "/adapters/a")
        assert _save(sched, worker, caches, _request("a", tokens, lora_request=a), list(range(9))) > 0
        again = _request("a2", tokens, lora_request=LoRARequest("adapter-a", 7, "/adapters/a"))
        assert sched.get_num_new_matched_tokens(again, 0)[0] >= 4 * C - 16  # control: same adapter hits
        other = _request("b", tokens, lora_request=LoRARequest("adapter-b", 2, "/adapters/b"))
        moved = _request("a3", tokens, lora_request=LoRARequest("adapter-a", 1, "/adapters/a-v2"))
        assert sched.get_num_new_matched_tokens(other, 0) == (0, False)
        assert sched.get_num_new_matched_tokens(moved, 0) == (0, False)  # a name re-pointed
        assert sched.get_num_new_matched_tokens(_request("base", tokens), 0) == (0, False)

        embeds = _request("e1", None, prompt_embeds=torch.randn(len(tokens), 64))
        assert _save(sched, worker, caches, embeds, list(range(10, 19))) == 0  # nothing saved
        later = _request("e2", None, prompt_embeds=torch.randn(len(tokens), 64))
        assert sched.get_num_new_matched_tokens(later, 0) == (0, False)
        for r in (again, other, moved, later):
            sched.request_finished(r)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_per_tenant_caches_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier_vllm import namespace as namespace_module

    from tests.test_vllm_connector_flow import _halves

    monkeypatch.setattr(namespace_module, "TENANT_CACHES", 8)
    sched, worker, _ = _halves(tmp_path)
    try:
        first = worker.cache_for(b"tenant-0")
        for i in range(1, 50):
            worker.cache_for(f"tenant-{i}".encode())
        assert len(worker._caches) == 8
        assert worker.cache_for(b"tenant-0") is not first  # made again, same namespace
        assert worker.cache_for(b"tenant-0").spec == first.spec
    finally:
        worker.shutdown()
        sched.shutdown()

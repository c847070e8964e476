"""The vLLM connector's two halves (scheduler and worker) wired together without an engine, over
zeroed paged CPU caches in vLLM 0.32's ``CPU_ATTN`` layout ``[blocks, heads, block, 2 * head_dim]``:
the harness of the flow, partial-chunk and KV-event tests (they drive the halves step by step)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def connector_halves(tmp_path: Path, *, chunk: int, block: int, blocks: int, heads: int, head_dim: int,
                     layers: int, cpu: dict[str, Any], vllm: dict[str, Any] | None = None,
                     kv_events: bool = False, name: str = "halves") -> tuple[Any, Any, dict[str, Any]]:
    """(scheduler half, registered worker half, the per-layer caches); ``cpu``: the cpu tier's
    settings, ``vllm``: the connector's own settings (the lookup socket lives in ``tmp_path``)."""
    import torch
    from kvtier_vllm.namespace import EngineInfo
    from kvtier_vllm.scheduler import SchedulerSide
    from kvtier_vllm.settings import load_settings
    from kvtier_vllm.worker import WorkerSide

    cfg, settings = load_settings({"chunk_tokens": chunk, "cpu": cpu,
                                   "vllm": {"socket_dir": str(tmp_path / "s"), **(vllm or {})}})
    info = EngineInfo(model_id=f"{name}-test", model_revision="", block_size=block, cache_dtype="auto",
                      rank=0, world_size=1, dp_rank=0, engine_id=f"{name}-{time.monotonic_ns()}",
                      backend="CPU_ATTN", isa="vec", kv_events=kv_events)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(blocks, heads, block, 2 * head_dim)
              for i in range(layers)}
    worker = WorkerSide(cfg, settings, info)
    worker.register(caches)
    sched = SchedulerSide(cfg, settings, block_size=block, engine_id=info.engine_id, dp_rank=0,
                          world_size=1, kv_events=kv_events)
    return sched, worker, caches


def fake_request(rid: str, tokens: list[int], salt: str | None = None) -> SimpleNamespace:
    """The fields of a vLLM ``Request`` the scheduler half reads."""
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, num_tokens=len(tokens),
                           num_prompt_tokens=len(tokens), num_computed_tokens=0, cache_salt=salt)


def scheduler_output(new: list[tuple[Any, list[int], int]], sched: dict[str, int]) -> SimpleNamespace:
    """A ``SchedulerOutput`` scheduling ``new`` (request, block ids, computed tokens) for the
    tokens ``sched`` gives per request id."""
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,), num_computed_tokens=c)
                            for r, ids, c in new],
        scheduled_cached_reqs=cached, num_scheduled_tokens=sched, preempted_req_ids=set(),
        kv_connector_block_state=None)

"""Real SGLang host pools and storage configs on CPU, for the checks in this directory.

These modules run only in the SGLang venv (scripts/test.sh builds it; tests/test_sglang.py
starts them), never in the main test environment: they import sglang at module level.
A real device pool (``MHATokenToKVPool`` / ``MLATokenToKVPool`` on ``device="cpu"``) gives the
buffer info the real host pool is built from; ``pin_memory=False`` because CPU torch cannot pin.
Host pools are booked against a fixed budget with SGLang's own ``host_memory_budget_scope`` (what
the scheduler does): otherwise SGLang keeps 10 GiB of the machine's free RAM in reserve, and these
tiny pools fail on a busy 24 GiB machine although they need kilobytes.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
HOST_BUDGET = 4 << 30
# kvtier's cpu tier commits its whole arena up front (1 GiB by default); these checks build dozens
# of backends on a shared machine, so their cpu tier is small unless a check sets its own. Its
# slots are left to the backend, which sizes them to one page (namespace.fit_slots).
SMALL_CPU = {"capacity_bytes": "64MiB"}
BACKEND = {"backend_name": "kvtier", "module_path": "kvtier_sglang", "class_name": "KVTierStorage",
           "interface_v1": 1}


def mha_pools(layout: str, *, page: int = 4, heads: int = 2, head_dim: int = 8, layers: int = 3,
              size: int = 64, dtype: torch.dtype = torch.bfloat16,
              ratio: float = 2.0) -> tuple[MHATokenToKVPool, MHATokenToKVPoolHost]:
    dev = MHATokenToKVPool(size=size, page_size=page, dtype=dtype, head_num=heads, head_dim=head_dim,
                           layer_num=layers, device="cpu", enable_memory_saver=False,
                           start_layer=0, end_layer=layers - 1)
    with host_memory_budget_scope(HOST_BUDGET):
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, ratio, 0, page, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer)
    return dev, host


def mla_host(layout: str, *, page: int = 4, layers: int = 3, size: int = 64,
             dtype: torch.dtype = torch.bfloat16) -> MLATokenToKVPoolHost:
    dev = MLATokenToKVPool(size, page, dtype, kv_lora_rank=32, qk_rope_head_dim=8, layer_num=layers,
                           device="cpu", enable_memory_saver=False, start_layer=0, end_layer=layers - 1)
    with host_memory_budget_scope(HOST_BUDGET):
        return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=dev.start_layer, end_layer=dev.end_layer,
                                    target_layer_num=layers)


def storage_config(layout: str, extra: dict[str, Any] | None = None, *, mla: bool = False,
                   model: str = "tiny", tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
                                enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model,
                                extra_config={**BACKEND, "cpu": SMALL_CPU, **(extra or {})})


def fill_random(host: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    buf = host.kv_buffer.view(-1)
    buf[:] = torch.randn(buf.numel(), generator=gen).to(buf.dtype)


def pages_of(host: Any, slots: torch.Tensor, page: int) -> list[torch.Tensor]:
    """Copies of the host pages starting at ``slots[::page]`` (SGLang's own page accessor)."""
    return [host.get_data_page(int(slots[i])).clone() for i in range(0, slots.numel(), page)]

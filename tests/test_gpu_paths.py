"""The CUDA path of the vLLM connector's copier: side streams, per-layer events, pinned captures.

Runs wherever a CUDA device is present (``-m gpu``), skipped elsewhere. The paged tensors use
vLLM 0.32's FlashAttention layout (logical ``[B, H, N, 2D]``, NHD in memory); results are
compared byte for byte with what the CPU path produces from the same inputs.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.blocks import detect_layout, gather_layer, kv_views
from kvtier_vllm.copier import CpuCopier, CudaCopier, RestoreItem

from kvtier.prefetch import LayerPipeline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
]

L, B, H, N, D, C = 4, 32, 8, 16, 64, 64  # C: chunk tokens (4 blocks)


def _caches(device: str) -> list[torch.Tensor]:
    return [torch.zeros(B, N, H, 2 * D, dtype=torch.float16, device=device).permute(0, 2, 1, 3)
            for _ in range(L)]


def _payloads(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(L, 2, C, H, D, generator=g).to(torch.float16) for _ in range(n)]


def _items(payloads: list[torch.Tensor], blocks: list[int]) -> list[RestoreItem]:
    per = C // N
    return [RestoreItem(p, 0, C, blocks[i * per:(i + 1) * per]) for i, p in enumerate(payloads)]


def test_layerwise_restore_on_a_side_stream_matches_the_cpu_path() -> None:
    dev = torch.device("cuda")
    layout = detect_layout(_caches("cpu")[0], backend="FLASH_ATTN", block_size=N, num_kv_heads=H, head_dim=D)
    gpu, cpu = _caches("cuda"), _caches("cpu")
    gviews = [kv_views(t, layout) for t in gpu]
    cviews = [kv_views(t, layout) for t in cpu]
    payloads = _payloads(3)
    blocks = [5, 9, 1, 30, 2, 7, 11, 13, 17, 19, 23, 29]
    items = _items(payloads, blocks)
    copier = CudaCopier(dev)
    pipe = LayerPipeline()
    copier.begin_restore(L)
    run = pipe.start(L, lambda layer: copier.restore_layer(gviews[layer], layer, items))
    for layer in range(L):
        assert run.wait(layer, 30)
        copier.layer_ready(layer)  # the compute stream now waits on that layer's event only
        # Work enqueued on the compute stream after the wait sees the restored blocks.
        probe = gviews[layer][0][blocks].float().sum()
        assert torch.isfinite(probe)
    copier.finish_restore()
    torch.cuda.current_stream().synchronize()
    CpuCopier().restore_blocking(cviews, items)
    for g, c in zip(gpu, cpu):
        assert torch.equal(g.cpu(), c)
    pipe.close()


def test_capture_into_pinned_staging_is_fenced_for_the_saver_thread() -> None:
    dev = torch.device("cuda")
    layout = detect_layout(_caches("cpu")[0], backend="FLASH_ATTN", block_size=N, num_kv_heads=H, head_dim=D)
    gpu = _caches("cuda")
    for t in gpu:
        t.normal_()
    views = [kv_views(t, layout) for t in gpu]
    blocks = [3, 8, 21, 4]
    copier = CudaCopier(dev)
    staging = copier.staging((L, 2, len(blocks) * N, H, D), torch.float16)
    assert staging.is_pinned()
    for layer in range(L):
        copier.capture_layer(views[layer], blocks, staging[layer])
    fence = copier.end_capture()
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: (fence.wait(), got.append(staging.clone())))
    t.start()
    t.join(30)
    for layer in range(L):
        ref = torch.empty(2, len(blocks) * N, H, D, dtype=torch.float16)
        gather_layer(kv_views(gpu[layer].cpu(), layout), blocks, ref)
        assert torch.equal(got[0][layer], ref)


def test_async_restore_blocking_completes_before_returning() -> None:
    dev = torch.device("cuda")
    layout = detect_layout(_caches("cpu")[0], backend="FLASH_ATTN", block_size=N, num_kv_heads=H, head_dim=D)
    gpu, cpu = _caches("cuda"), _caches("cpu")
    items = _items(_payloads(2), [6, 0, 12, 31, 14, 15, 16, 3])
    CudaCopier(dev).restore_blocking([kv_views(t, layout) for t in gpu], items)
    CpuCopier().restore_blocking([kv_views(t, layout) for t in cpu], items)
    for g, c in zip(gpu, cpu):
        assert torch.equal(g.cpu(), c)

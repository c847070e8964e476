"""Gather/scatter between vLLM paged KV tensors and kvtier chunk payloads: exact equality.

Layouts: vLLM 0.32 CPU (``[B, H, N, 2D]``, K stored transposed per block, written here both by
vLLM's own ``cpu_attn_reshape_and_cache`` kernel and by an independent reference writer),
vLLM 0.32 GPU backends (``[B, H, N, 2D]`` split on the last dim, NHD and HND physical orders,
as FlashAttention reads it: ``kv.transpose(1, 2).split(D, -1)``), the pre-0.32 FlashAttention
``[2, B, N, H, D]`` layout, and opaque block bytes. CPU tensors stand in for GPU ones.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.blocks import (
    PagedLayout,
    detect_layout,
    dtype_name,
    gather_layer,
    gather_layer_host,
    kv_views,
    payload_tensor,
    scatter_layer,
    scatter_layer_host,
)

B, H, N, D = 7, 2, 16, 8
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _kv(t: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, H, D, generator=g).to(dtype), torch.randn(t, H, D, generator=g).to(dtype))


def _slots(blocks: list[int], t: int, n: int = N) -> list[tuple[int, int]]:
    return [(blocks[i // n], i % n) for i in range(t)]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _write_cpu_reference(kv: torch.Tensor, key: torch.Tensor, val: torch.Tensor, blocks: list[int]) -> None:
    """Independent writer of the CPU layout: per (block, head) K as [D, N] then V as [N, D]."""
    flat = kv.view(kv.shape[0], H, 2 * N * D)
    for i, (b, n) in enumerate(_slots(blocks, key.shape[0])):
        for h in range(H):
            for d in range(D):
                flat[b, h, d * N + n] = key[i, h, d]
            flat[b, h, N * D + n * D:N * D + (n + 1) * D] = val[i, h]


def _write_split_c(kv: torch.Tensor, key: torch.Tensor, val: torch.Tensor, blocks: list[int]) -> None:
    """Write exactly as vLLM 0.32's FlashAttention reads: kv.transpose(1, 2).split(D, -1)."""
    kc, vc = kv.transpose(1, 2).split(D, dim=-1)  # [B, N, H, D] each
    for i, (b, n) in enumerate(_slots(blocks, key.shape[0])):
        kc[b, n], vc[b, n] = key[i], val[i]


def _check_roundtrip(kv: torch.Tensor, layout: PagedLayout, key: torch.Tensor, val: torch.Tensor,
                     blocks: list[int]) -> None:
    t = key.shape[0]
    views = kv_views(kv, layout)
    out = torch.empty(2, len(blocks) * N, H, D, dtype=kv.dtype)
    gather_layer(views, blocks, out)
    assert torch.equal(_bits(out[0, :t]), _bits(key)) and torch.equal(_bits(out[1, :t]), _bits(val))
    # Scatter into a fresh cache at other block ids, gather back: identical bytes, and every
    # block we did not name is untouched.
    fresh = torch.full_like(kv, 7)
    before = fresh.clone()
    dst = [(b + 3) % layout.num_blocks for b in blocks]  # other, still distinct, block ids
    fviews = kv_views(fresh, layout)
    scatter_layer(fviews, dst, out)
    back = torch.empty_like(out)
    gather_layer(fviews, dst, back)
    assert torch.equal(_bits(back), _bits(out))
    untouched = [b for b in range(layout.num_blocks) if b not in dst]
    if layout.kind == "kv_first":
        assert torch.equal(fresh[:, untouched], before[:, untouched])
    else:
        assert torch.equal(fresh[untouched], before[untouched])
    # The single-threaded host copies (used off the forward thread) give identical bytes.
    host_out = torch.empty_like(out)
    gather_layer_host(views, blocks, host_out)
    assert torch.equal(_bits(host_out), _bits(out))
    fresh2 = torch.full_like(kv, 7)
    scatter_layer_host(kv_views(fresh2, layout), dst, out)
    assert torch.equal(_bits(fresh2), _bits(fresh))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_layout_reference_writer(dtype: torch.dtype) -> None:
    kv = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    key, val = _kv(2 * N - 3, dtype)
    blocks = [4, 1]
    _write_cpu_reference(kv, key, val, blocks)
    layout = detect_layout(kv, backend="CPU_ATTN", block_size=N, num_kv_heads=H, head_dim=D, isa="vec")
    assert layout.kind == "cpu_vec" and layout.canonical
    _check_roundtrip(kv, layout, key, val, blocks)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")
@pytest.mark.parametrize("dtype,block,head_dim,isa", [
    (torch.float32, 128, 64, "vec"),      # the exact shape vLLM 0.32 hands over for tests/vllm_model.py
    (torch.bfloat16, 128, 128, "vec"),
    (torch.float16, 32, 64, "vec"),
    (torch.float32, 16, 64, "vec16"),
])
def test_cpu_layout_matches_vllm_kernel(dtype: torch.dtype, block: int, head_dim: int, isa: str) -> None:
    ops = pytest.importorskip("vllm._custom_ops")
    nb, h = 6, 2
    kv = torch.zeros(nb, h, block, 2 * head_dim, dtype=dtype)
    # Exactly how CPUAttentionBackendImpl splits the cache before calling the kernel.
    kc, vc = kv.view(nb, h, 2 * block, head_dim).chunk(2, dim=2)
    t = 3 * block - 5
    g = torch.Generator().manual_seed(1)
    key = torch.randn(t, h, head_dim, generator=g).to(dtype)
    val = torch.randn(t, h, head_dim, generator=g).to(dtype)
    blocks = [4, 1, 3]
    slots = torch.tensor([blocks[i // block] * block + i % block for i in range(t)], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, val, kc, vc, slots, isa)
    layout = detect_layout(kv, backend="CPU_ATTN", block_size=block, num_kv_heads=h,
                           head_dim=head_dim, isa=isa)
    assert layout.kind == "cpu_vec"
    out = torch.empty(2, 3 * block, h, head_dim, dtype=dtype)
    gather_layer(kv_views(kv, layout), blocks, out)
    assert torch.equal(_bits(out[0, :t]), _bits(key)) and torch.equal(_bits(out[1, :t]), _bits(val))
    # Scatter back into a zeroed cache must reproduce the kernel's bytes in those blocks.
    again = torch.zeros_like(kv)
    scatter_layer(kv_views(again, layout), blocks, out)
    for b in blocks:
        rows = again[b].view(h, 2, -1)
        ref = kv[b].view(h, 2, -1)
        assert torch.equal(_bits(rows[:, 1]), _bits(ref[:, 1]))  # V: whole block rows
    assert torch.equal(_bits(again[blocks[:2]]), _bits(kv[blocks[:2]]))  # full blocks: identical


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_flash_attention_split_c_layout(dtype: torch.dtype, physical: str) -> None:
    if physical == "NHD":  # LBNHC: memory [B, N, H, 2D], logical [B, H, N, 2D]
        kv = torch.zeros(B, N, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3)
    else:                  # LBHNC: memory order equals the logical order
        kv = torch.zeros(B, H, N, 2 * D, dtype=dtype)
    key, val = _kv(3 * N, dtype, seed=2)
    blocks = [2, 5, 0]
    _write_split_c(kv, key, val, blocks)
    layout = detect_layout(kv, backend="FLASH_ATTN", block_size=N, num_kv_heads=H, head_dim=D)
    assert layout.kind == "split_c"
    _check_roundtrip(kv, layout, key, val, blocks)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_attention_legacy_kv_first_layout(dtype: torch.dtype) -> None:
    kv = torch.zeros(2, B, N, H, D, dtype=dtype)  # vLLM <= 0.1x FlashAttention
    key, val = _kv(N + 5, dtype, seed=3)
    blocks = [6, 3]
    for i, (b, n) in enumerate(_slots(blocks, key.shape[0])):
        kv[0, b, n], kv[1, b, n] = key[i], val[i]
    layout = detect_layout(kv, backend="FLASH_ATTN", block_size=N, num_kv_heads=H, head_dim=D)
    assert layout.kind == "kv_first"
    _check_roundtrip(kv, layout, key, val, blocks)


def test_opaque_layout_roundtrips_block_bytes() -> None:
    kv = torch.randn(B, H, N, 2 * D)
    layout = detect_layout(kv, backend="CPU_ATTN", block_size=N, num_kv_heads=H, head_dim=D, isa="amx")
    assert layout.kind == "opaque" and not layout.canonical
    out = torch.empty(2, 2 * N, H, D)
    gather_layer(kv_views(kv, layout), [3, 1], out)
    fresh = torch.zeros_like(kv)
    scatter_layer(kv_views(fresh, layout), [3, 1], out)
    assert torch.equal(fresh[[3, 1]], kv[[3, 1]]) and not fresh[[0, 2, 4, 5, 6]].any()


def test_chunk_payload_bytes_roundtrip_through_payload_tensor() -> None:
    # A chunk payload (L, 2, C, H, D) made by gathering two layers, turned into bytes and
    # back into a tensor without a copy, restores the same blocks exactly.
    layers, c = 2, 2 * N
    caches = [torch.randn(B, H, N, 2 * D) for _ in range(layers)]
    layout = detect_layout(caches[0], backend="CPU_ATTN", block_size=N, num_kv_heads=H, head_dim=D, isa="vec")
    staging = torch.empty(layers, 2, c, H, D)
    for lay, cache in enumerate(caches):
        gather_layer(kv_views(cache, layout), [5, 2], staging[lay])
    data = bytes(staging.view(torch.uint8).numpy())
    payload = payload_tensor(memoryview(data), (layers, 2, c, H, D), torch.float32)
    for lay in range(layers):
        fresh = torch.zeros_like(caches[lay])
        scatter_layer(kv_views(fresh, layout), [1, 4], payload[lay])
        assert torch.equal(fresh[[1, 4]], caches[lay][[5, 2]])


def test_gather_checks_out_shape_and_detect_refuses_unknown() -> None:
    kv = torch.zeros(B, H, N, 2 * D)
    layout = detect_layout(kv, backend="CPU_ATTN", block_size=N, num_kv_heads=H, head_dim=D, isa="vec")
    with pytest.raises(ValueError):
        gather_layer(kv_views(kv, layout), [1], torch.empty(2, N + 1, H, D))
    with pytest.raises(ValueError):
        scatter_layer(kv_views(kv, layout), [1, 2], torch.empty(2, N, H, D))
    with pytest.raises(ValueError):
        gather_layer_host(kv_views(kv, layout), [1], torch.empty(2, N + 1, H, D))
    with pytest.raises(ValueError):
        scatter_layer_host(kv_views(kv, layout), [1, 2], torch.empty(2, N, H, D))
    with pytest.raises(ValueError):
        detect_layout(torch.zeros(B, N, 3), backend="FLASHMLA", block_size=N, num_kv_heads=H, head_dim=D)
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError):
        dtype_name(torch.complex64)

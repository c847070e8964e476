"""Pure gather/scatter between vLLM's paged per-layer KV tensors and kvtier chunk payloads.

A kvtier chunk payload is ``(layers, kv=2, tokens, kv_heads, head_dim)``, C-contiguous. vLLM
keeps one tensor per attention layer whose first logical dimension is the block id; how K and V
sit inside a block depends on the attention backend and the vLLM version:

``cpu_vec``   vLLM 0.32 ``CPU_ATTN`` with the ``vec``/``vec16`` ISAs. Tensor ``[B, H, N, 2*D]``;
              each (block, head) row of ``N*2*D`` elements holds K *transposed* as ``[D, N]``
              followed by V as ``[N, D]`` (checked against vLLM's own
              ``cpu_attn_reshape_and_cache`` kernel in tests/test_vllm_blocks.py).
``split_c``   vLLM 0.32 GPU backends (FLASH_ATTN, TRITON_ATTN, FLEX, ...): logical
              ``[B, H, N, 2*D]`` with any physical stride order (NHD or HND); the last dim is
              ``K(D) | V(D)`` of one token and head.
``kv_first``  vLLM <= 0.1x FlashAttention: ``[2, B, N, H, D]`` (K plane, then V plane).
``mla``       MLA latent caches (DeepSeek-style): ``[B, N, D]`` (vLLM 0.32 GPU MLA backends) or
              ``[B, 1, N, D]``, D = kv_lora_rank + rope dim (576): one plane, not K and V.
              Chunks carry ``kv=1`` and one head, so the payload says what it is.
``opaque``    anything else whose blocks are contiguous (other CPU ISAs, quantised layouts):
              the block's bytes are copied as they are. Exact within one engine build, but the
              bytes are not the canonical layout, so the connector adds the layout tag to the
              namespace and such chunks never meet another layout.

Everything here is torch only (no vLLM import), works on any device, and never copies more
than once per direction: gathers write into caller-owned ``out`` tensors, scatters write through
strided views into the engine's own tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("cpu_vec", "split_c", "kv_first", "mla", "opaque")
# CPU ISAs whose cache layout was verified against the kernel; AMX/NEON/... stay opaque.
CPU_VEC_ISAS = ("vec", "vec16")

# One layer's paged KV as canonical ``[num_blocks, N, H, D]`` planes: (K, V), or (latent,) for MLA.
Views = tuple[torch.Tensor, ...]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8, "int8": torch.int8,
}


def dtype_name(dtype: torch.dtype) -> str:
    """kvtier's name for a torch dtype (ValueError when kvtier's chunk format lacks it)."""
    for name, dt in TORCH_DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"KV dtype {dtype} has no kvtier chunk code")


@dataclass(frozen=True)
class PagedLayout:
    """How one layer's paged tensor maps onto canonical per-block ``[N, H, D]`` K and V."""

    kind: str
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown paged layout kind {self.kind!r}; expected one of {KINDS}")

    @property
    def canonical(self) -> bool:
        """True when gathered bytes are the engine-neutral ``(kv, tokens, heads, dim)`` order."""
        return self.kind != "opaque"

    @property
    def planes(self) -> int:
        """Planes per token: 2 (K and V) or 1 (an MLA latent)."""
        return 1 if self.kind == "mla" else 2

    @property
    def block_elems(self) -> int:
        return self.planes * self.block_size * self.num_kv_heads * self.head_dim


def detect_layout(t: torch.Tensor, *, backend: str, block_size: int, num_kv_heads: int,
                  head_dim: int, isa: str | None = None, mla: bool = False) -> PagedLayout:
    """Classify ``t`` (one layer's KV cache as handed to ``register_kv_caches``); ``mla``: the
    model uses MLA (vLLM's ``model_config.use_mla``), so ``head_dim`` is the latent width.

    Raises ValueError when the tensor cannot be handled at all (then the connector disables
    itself rather than risk wrong bytes).
    """
    shape = tuple(t.shape)
    name = backend.upper()
    if mla:
        if (len(shape) == 3 and shape[1:] == (block_size, head_dim)
                or len(shape) == 4 and shape[1:] == (1, block_size, head_dim)) and t.stride(-1) == 1:
            return PagedLayout("mla", shape[0], block_size, 1, head_dim)
        raise ValueError(f"unsupported MLA KV cache tensor: shape {shape}, strides {t.stride()}")
    four_d = len(shape) == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim)
    if len(shape) == 5 and shape[0] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
        return PagedLayout("kv_first", shape[1], block_size, num_kv_heads, head_dim)
    if four_d and name.startswith("CPU"):
        kind = "cpu_vec" if isa in CPU_VEC_ISAS else "opaque"
        if not _block_contiguous(t):
            raise ValueError(f"CPU KV tensor with strides {t.stride()} has non-contiguous blocks")
        return PagedLayout(kind, shape[0], block_size, num_kv_heads, head_dim)
    if four_d and t.stride(3) == 1:
        return PagedLayout("split_c", shape[0], block_size, num_kv_heads, head_dim)
    if shape and _block_contiguous(t) and t[0].numel() == 2 * block_size * num_kv_heads * head_dim:
        return PagedLayout("opaque", shape[0], block_size, num_kv_heads, head_dim)
    raise ValueError(f"unsupported KV cache tensor: backend {backend}, shape {shape}, "
                     f"strides {t.stride()}")


def _block_contiguous(t: torch.Tensor) -> bool:
    return t.dim() >= 2 and t[0].is_contiguous()


def kv_views(t: torch.Tensor, layout: PagedLayout) -> Views:
    """(K, V), each a strided ``[num_blocks, N, H, D]`` view sharing ``t``'s storage; for MLA
    the one latent plane ``[num_blocks, N, 1, D]``.

    For ``opaque`` layouts the two views are the two halves of each block's raw elements,
    shaped ``[num_blocks, N, H, D]`` only by reinterpretation.
    """
    b, n, h, d = layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
    if layout.kind == "cpu_vec":
        k = t.view(b, h, 2, d, n)[:, :, 0].permute(0, 3, 1, 2)
        v = t.view(b, h, 2, n, d)[:, :, 1].permute(0, 2, 1, 3)
        return k, v
    if layout.kind == "split_c":
        return t[..., :d].permute(0, 2, 1, 3), t[..., d:].permute(0, 2, 1, 3)
    if layout.kind == "kv_first":
        return t[0], t[1]
    if layout.kind == "mla":
        return (t.view(b, n, 1, d),) if t.dim() == 3 else (t.permute(0, 2, 1, 3),)
    raw = t.view(b, 2, n, h, d)
    return raw[:, 0], raw[:, 1]


def _index(block_ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(device=device, dtype=torch.long)
    return torch.tensor(list(block_ids), dtype=torch.long, device=device)


def gather_layer(views: Views, block_ids: Sequence[int] | torch.Tensor, out: torch.Tensor) -> None:
    """Copy blocks ``block_ids`` of one layer into ``out`` ``[P, len(block_ids)*N, H, D]``
    (P planes: 2 for K/V, 1 for an MLA latent).

    ``out`` must be contiguous and on the views' device; the copy runs on the current stream.
    """
    idx = _index(block_ids, views[0].device)
    nb = idx.numel()
    n, h, d = views[0].shape[1:]
    want = (len(views), nb * n, h, d)
    if tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {want}, got {tuple(out.shape)}")
    for plane, src in enumerate(views):
        torch.index_select(src, 0, idx, out=out[plane].view(nb, n, h, d))


def scatter_layer(views: Views, block_ids: Sequence[int] | torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src`` ``[P, len(block_ids)*N, H, D]`` into blocks ``block_ids`` of one layer."""
    idx = _index(block_ids, views[0].device)
    nb = idx.numel()
    n, h, d = views[0].shape[1:]
    want = (len(views), nb * n, h, d)
    if tuple(src.shape) != want:
        raise ValueError(f"src must be {want}, got {tuple(src.shape)}")
    for plane, dst in enumerate(views):
        dst.index_copy_(0, idx, src[plane].reshape(nb, n, h, d))


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _np(t: torch.Tensor) -> Any:
    """A numpy view of a CPU tensor's bits (any dtype, any strides; no copy)."""
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


def gather_layer_host(views: Views, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """``gather_layer`` for CPU tensors as single-threaded block copies (numpy).

    Why: kvtier's loader/saver threads run beside the forward pass; a torch op there would
    start an OpenMP team as wide as the engine's and fight it for the cores. A per-block copy
    is also ~2x faster than ``index_select`` through the transposed K view.
    """
    n, h, d = views[0].shape[1:]
    nb = len(block_ids)
    want = (len(views), nb * n, h, d)
    if tuple(out.shape) != want or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {want}, got {tuple(out.shape)}")
    for plane, src in enumerate(views):
        s, o = _np(src), _np(out[plane]).reshape(nb, n, h, d)
        for j, b in enumerate(block_ids):
            o[j] = s[b]


def scatter_layer_host(views: Views, block_ids: Sequence[int], src: torch.Tensor) -> None:
    """``scatter_layer`` for CPU tensors as single-threaded block copies (see above)."""
    n, h, d = views[0].shape[1:]
    nb = len(block_ids)
    want = (len(views), nb * n, h, d)
    if tuple(src.shape) != want:
        raise ValueError(f"src must be {want}, got {tuple(src.shape)}")
    for plane, dst in enumerate(views):
        dn, sn = _np(dst), _np(src[plane]).reshape(nb, n, h, d)
        for j, b in enumerate(block_ids):
            dn[b] = sn[j]


def payload_tensor(payload: memoryview | bytes | bytearray, shape: Sequence[int],
                   dtype: torch.dtype) -> torch.Tensor:
    """A read-only CPU tensor over a chunk payload's bytes, without copying them."""
    import warnings

    with warnings.catch_warnings():
        # frombuffer warns that bytes are not writable; we only ever read these tensors.
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=dtype)
    return flat.view(*shape)


def heads_dim(shape: tuple[int, ...], block_size: int, mla: bool = False) -> tuple[int, int]:
    """(kv heads, head dim) from a KV tensor shape: [B, H, N, 2D] or [2, B, N, H, D]; for MLA
    one "head" of the latent's full width ([B, N, D] or [B, 1, N, D])."""
    if mla:
        return 1, shape[-1]
    if len(shape) == 5 and shape[0] == 2:
        return shape[3], shape[4]
    if len(shape) == 4 and shape[2] == block_size and shape[3] % 2 == 0:
        return shape[1], shape[3] // 2
    raise ValueError(f"cannot read kv heads / head dim from KV tensor shape {shape}")

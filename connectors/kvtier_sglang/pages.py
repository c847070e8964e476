"""Host-pool pages as views in kvtier's canonical chunk order.

SGLang's host pools lay a page out differently per ``--hicache-mem-layout`` (the bytes behind
``get_page_buffer_meta`` of one page are ``[2, L, P, H, D]`` for ``layer_first`` but
``[2, P, L, H, D]`` for ``page_first``, ...). Storing those bytes raw under layout-less keys
would restore scrambled K/V into an instance using another layout, and no other engine could
read them. So every page is stored in kvtier's canonical chunk order
``(layers, kv, tokens, heads, head_dim)`` (the order kvtier_hf and kvtier_vllm write), and this
module gives, for any layout, a strided *view* of one page of the pool's own buffer in that
order: a store is one strided copy out of the pool, a load one strided copy into it, with no
intermediate tensor per page.

Layouts (``kv_buffer`` shapes from ``sglang.srt.mem_cache.pool_host``; N slots, P page tokens):

    MHA layer_first        (2, L, N, H, D)
    MHA page_first         (2, N, L, H, D)
    MHA page_first_direct  (2, N/P, L, P, H, D)
    MHA page_head          (2, N/P, H, P, L, D)
    MLA layer_first        (L, N, 1, D)
    MLA page_first         (N, L, 1, D)
    MLA page_first_direct  (N/P, L, P, 1, D)

Other layouts (``page_unified``, ``page_first_kv_split``, head-split pages) are refused with a
ValueError naming the layout. torch and kvtier.strided; imports no SGLang.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.strided import Runs, accelerated, gather_into, runs_of, scatter_from

Buffer = bytes | bytearray | memoryview  # what torch.frombuffer reads (mmap slices as memoryviews)

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class PageGeometry:
    """What one page holds: ``kv`` is 2 (K and V) or 1 (an MLA latent); canonical shape is
    ``(layers, kv, page_tokens, heads, head_dim)``."""

    layout: str
    is_mla: bool
    layers: int
    heads: int
    head_dim: int
    page_tokens: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        allowed = MLA_LAYOUTS if self.is_mla else MHA_LAYOUTS
        if self.layout not in allowed:
            kind = "MLA" if self.is_mla else "MHA"
            raise ValueError(f"host layout {self.layout!r} is not supported for {kind} pools by "
                             f"kvtier_sglang; use one of {allowed} (--hicache-mem-layout)")

    @property
    def kv(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def canonical_shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, self.kv, self.page_tokens, self.heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return int(np.prod(self.canonical_shape)) * self.dtype.itemsize

    def buffer_dims(self, slots: int) -> tuple[int, ...]:
        """Shape of a host buffer of ``slots`` token slots in this layout (a multiple of the
        page size for the per-page layouts); a single page is ``buffer_dims(page_tokens)``."""
        L, H, D, P = self.layers, self.heads, self.head_dim, self.page_tokens
        if self.is_mla:
            return {"layer_first": (L, slots, 1, D), "page_first": (slots, L, 1, D),
                    "page_first_direct": (slots // P, L, P, 1, D)}[self.layout]
        return {"layer_first": (2, L, slots, H, D), "page_first": (2, slots, L, H, D),
                "page_first_direct": (2, slots // P, L, P, H, D),
                "page_head": (2, slots // P, H, P, L, D)}[self.layout]


def page_view(geo: PageGeometry, buffer: torch.Tensor, slot: int) -> torch.Tensor:
    """The page starting at token ``slot`` of ``buffer`` (a tensor of ``geo.buffer_dims(n)``),
    viewed in canonical order. A view: writing it writes the buffer. ``slot`` must be
    page-aligned (SGLang's host allocator hands out whole pages)."""
    P = geo.page_tokens
    if slot % P:
        raise ValueError(f"host slot {slot} is not aligned to the page size {P}")
    page = slot // P
    if geo.is_mla:
        if geo.layout == "layer_first":
            return buffer[:, slot:slot + P].unsqueeze(1)
        if geo.layout == "page_first":
            return buffer[slot:slot + P].permute(1, 0, 2, 3).unsqueeze(1)
        return buffer[page].unsqueeze(1)                                   # page_first_direct
    if geo.layout == "layer_first":
        return buffer[:, :, slot:slot + P].permute(1, 0, 2, 3, 4)
    if geo.layout == "page_first":
        return buffer[:, slot:slot + P].permute(2, 0, 1, 3, 4)
    if geo.layout == "page_first_direct":
        return buffer[:, page].permute(1, 0, 2, 3, 4)
    return buffer[:, page].permute(3, 0, 2, 1, 4)                         # page_head


def load_page(view: torch.Tensor, payload: Buffer) -> None:
    """Copy a page's canonical bytes ``payload`` (exactly the page's size; read-only is fine)
    into ``view`` (a :func:`page_view`). With kvtier's C loop (:mod:`kvtier.strided`), runs
    of the page written with streaming stores; else torch's strided copy, on the page's own
    dtype (about 20 % faster here than numpy's copy of the same bytes: 9-10 vs 7.5-8 GB/s for
    1 KiB runs, one thread), on torch's intra-op threads as the server set them."""
    if accelerated() and view.device.type == "cpu":
        base, start, runs = _region(view)
        scatter_from(base, start, runs, _checked(payload, view))
        return
    view.copy_(_tensor_over(payload, view))


def save_page(view: torch.Tensor, out: Buffer) -> None:
    """Copy ``view`` (a :func:`page_view`) into the writable buffer ``out`` (exactly the
    page's size) in canonical order: torch's copy, for a buffer read at once (a codec's
    scratch page)."""
    _tensor_over(out, view).copy_(view)


def save_page_hashed(view: torch.Tensor, out: Buffer, *, streaming: bool = True) -> int:
    """:func:`save_page`, returning the xxh3_64 of the bytes written (a raw chunk's payload
    checksum). ``streaming`` (a cache's slot, not read again soon): kvtier's C loop, the hash
    taken during the copy; else (a buffer a write takes at once) torch's copy, then xxh3."""
    if streaming and accelerated() and view.device.type == "cpu":
        base, start, runs = _region(view)
        return gather_into(_checked(out, view), base, start, runs)
    save_page(view, out)
    return xxhash.xxh3_64_intdigest(out)


@functools.lru_cache(maxsize=64)
def _runs(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> Runs:
    return runs_of(shape, tuple(s * itemsize for s in strides), itemsize)


def _region(view: torch.Tensor) -> tuple[np.ndarray, int, Runs]:
    """(the bytes of ``view``'s whole storage, where ``view`` starts in them, its runs)."""
    storage = view.untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,)).numpy()
    start = int(view.storage_offset()) * view.element_size()
    return whole, start, _runs(tuple(view.shape), view.stride(), view.element_size())


def _checked(buf: Buffer, like: torch.Tensor) -> Buffer:
    n = memoryview(buf).nbytes
    if n != page_nbytes(like):
        raise ValueError(f"a page of {tuple(like.shape)} {like.dtype} is {page_nbytes(like)} bytes, "
                         f"the buffer {n}")
    return buf


def page_nbytes(view: torch.Tensor) -> int:
    return view.numel() * view.element_size()


def _tensor_over(buf: Buffer, like: torch.Tensor) -> torch.Tensor:
    return torch.frombuffer(_checked(buf, like), dtype=like.dtype).view(like.shape)


# torch warns (once per process) that a tensor over a read-only buffer must not be written: the
# page copies only read those (chunks verified where they lie). Spend that one warning here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.frombuffer(memoryview(bytes(2)).toreadonly(), dtype=torch.uint8)


def page_slots(host_indices: torch.Tensor, npages: int, page_tokens: int) -> list[int]:
    """The first slot of each of ``npages`` pages in ``host_indices``; ValueError when the
    indices do not hold exactly ``npages`` whole, contiguous pages."""
    if host_indices.numel() != npages * page_tokens:
        raise ValueError(f"{host_indices.numel()} host indices for {npages} pages of "
                         f"{page_tokens} tokens (expected {npages * page_tokens})")
    if npages == 0:
        return []
    pages = host_indices.reshape(npages, page_tokens).to(torch.int64)
    firsts = pages[:, 0]
    if page_tokens > 1 and not bool((pages - firsts[:, None] == torch.arange(page_tokens)).all()):
        raise ValueError("host indices of a page are not one contiguous page")
    return [int(s) for s in firsts.tolist()]



def geometry_of(pool: Any, is_mla: bool) -> PageGeometry:
    """Geometry of an SGLang host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``,
    duck-typed), checked against its ``kv_buffer`` shape; ValueError when they disagree, or
    when the pool keeps part of a page outside ``kv_buffer`` and says so (its storage page
    accessor raises NotImplementedError: SGLang's MXFP8 pool, whose per-page scales live in
    other buffers; storing ``kv_buffer`` alone would restore pages with stale scales)."""
    probe = getattr(pool, "get_page_buffer_meta", None)
    if probe is not None:
        try:
            probe(torch.arange(int(pool.page_size), dtype=torch.int64))
        except NotImplementedError as exc:
            raise ValueError(f"{type(pool).__name__} has no flat storage pages for kvtier_sglang "
                             f"to store: {exc}") from None
        except (ValueError, AssertionError, TypeError, IndexError, RuntimeError):
            pass  # a layout whose zero-copy accessor SGLang lacks: kvtier does not use it
    if is_mla:
        heads, head_dim = 1, int(pool.kv_cache_dim)
    else:
        heads, head_dim = int(pool.head_num), int(pool.head_dim)
    buffer = getattr(pool, "kv_buffer", None)
    if not isinstance(buffer, torch.Tensor):
        raise ValueError(f"{type(pool).__name__} has no materialised kv_buffer tensor")
    geo = PageGeometry(layout=str(pool.layout), is_mla=is_mla, layers=int(pool.layer_num),
                       heads=heads, head_dim=head_dim, page_tokens=int(pool.page_size),
                       dtype=buffer.dtype)
    expect = geo.buffer_dims(int(pool.size))
    if tuple(buffer.shape) != expect:
        raise ValueError(f"{type(pool).__name__} kv_buffer shape {tuple(buffer.shape)} is not the "
                         f"{geo.layout} shape {expect} kvtier_sglang expects")
    return geo

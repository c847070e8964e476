"""Conversion between a transformers cache and kvtier chunk payloads.

Chunk payload layout (what every engine connector writes, see kvtier/cache.py):
``(layers, kv=2, tokens, kv_heads, head_dim)``, C-contiguous, in the namespace's KV dtype.
transformers keeps per layer ``keys`` / ``values`` of shape ``(batch, kv_heads, seq, head_dim)``;
kvtier_hf handles batch 1, so a chunk is ``stack(k[0, :, s:e], v[0, :, s:e])`` per layer with the
token and head axes swapped.

Ownership: :func:`kv_payload` returns a fresh buffer the caller owns (the store takes it);
:func:`cache_from_chunks` copies out of the payloads, so the caller may drop them afterwards.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.chunk import Shape
from kvtier.codec import Buf
from kvtier.keys import KVLayout
from kvtier_hf.compat import cache_layers, layer_kv, new_cache


def _check_layer(k: torch.Tensor, v: torch.Tensor, layout: KVLayout, dtype: torch.dtype,
                 layer: int) -> None:
    for name, t in (("keys", k), ("values", v)):
        if t.dim() != 4 or t.shape[0] != 1 or t.shape[1] != layout.num_kv_heads \
                or t.shape[3] != layout.head_dim:
            raise ValueError(
                f"layer {layer} {name} have shape {tuple(t.shape)}; the namespace expects "
                f"(1, {layout.num_kv_heads}, seq, {layout.head_dim})")
        if t.dtype != dtype:
            # Same byte count is not the same bytes (float16 vs bfloat16): refuse, never guess.
            raise ValueError(f"layer {layer} {name} are {t.dtype}; the namespace's KV dtype is {dtype}")


def kv_payload(cache: Any, start: int, end: int, layout: KVLayout, dtype: torch.dtype) -> Buf:
    """Raw bytes of tokens ``[start, end)`` of ``cache`` (batch 1) in chunk layout."""
    if cache_layers(cache) != layout.num_layers:
        raise ValueError(f"cache has {cache_layers(cache)} layers; the namespace expects {layout.num_layers}")
    parts = []
    for layer in range(layout.num_layers):
        k, v = layer_kv(cache, layer)
        _check_layer(k, v, layout, dtype, layer)
        if k.shape[2] < end:
            raise ValueError(f"cache holds {k.shape[2]} tokens, asked for [{start}, {end})")
        parts.append(torch.stack((k[0, :, start:end], v[0, :, start:end])))  # (2, H, T, D)
    block = torch.stack(parts).detach().transpose(2, 3).contiguous().cpu()  # (L, 2, T, H, D)
    # The numpy array keeps ``block`` alive for as long as the memoryview lives.
    return block.view(torch.uint8).numpy().data


def _as_tensor(payload: Buf, dtype: torch.dtype, shape: Shape) -> torch.Tensor:
    with warnings.catch_warnings():
        # Payloads are read-only views into the store's bytes; we only read (and copy) them.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(payload, dtype=dtype).view(shape)


Devices = torch.device | str | Sequence[torch.device | str]


def layer_device(devices: Devices, layer: int) -> torch.device | str:
    """Where layer ``layer``'s K/V go: one device for all, or one per layer."""
    return devices if isinstance(devices, (torch.device, str)) else devices[layer]


def kv_devices(model: torch.nn.Module, num_layers: int) -> list[torch.device]:
    """The device of each layer's attention (its K/V must live there): a model split over
    GPUs with ``device_map`` runs layer i where its weights are, and the cache's next update
    concatenates onto restored K/V on that device. transformers' attention modules carry
    ``layer_idx``. A module under an accelerate hook runs on the hook's ``execution_device``
    (an offloaded layer keeps its weights on ``meta`` between forwards); a layer none names,
    or whose weights are on ``meta`` with no hook, gets the first parameter's device."""
    first = next(model.parameters()).device
    out = [first] * num_layers
    hooked: dict[str, torch.device] = {}
    for name, module in model.named_modules():
        dev = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
        if dev is not None:
            hooked[name] = torch.device(f"cuda:{dev}" if isinstance(dev, int) else dev)
    for name, module in model.named_modules():
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int) or not 0 <= idx < num_layers:
            continue
        owner = name
        while owner not in hooked and owner:
            owner = owner.rpartition(".")[0]
        if owner in hooked:
            out[idx] = hooked[owner]
            continue
        param = next(module.parameters(recurse=True), None)
        if param is not None and param.device.type != "meta":
            out[idx] = param.device
    return out


def fresh_kv(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor whose pages fault in as transparent huge pages where the
    kernel offers them: numpy's allocator advises ``MADV_HUGEPAGE`` for arrays of 4 MiB and
    more, torch's does not. The restore writes every byte of fresh KV tensors, and faulting
    them in 4 KiB at a time cost 3-6x the copy itself here (a 10 MB layer stack: 5.5-6 ms
    from torch.empty, 0.9-2 ms from np.empty, same copy)."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def cache_from_chunks(payloads: Sequence[Buf], shapes: Sequence[Shape], tokens: int,
                      layout: KVLayout, dtype: torch.dtype, config: Any = None,
                      device: Devices = "cpu") -> Any:
    """A new DynamicCache holding the first ``tokens`` tokens of the given chunks (in order;
    the last chunk used may be cut short). ``tokens`` must not exceed what the chunks cover."""
    cover = sum(s[2] for s in shapes)
    if tokens > cover:
        raise ValueError(f"asked for {tokens} tokens, the chunks cover {cover}")
    if tokens <= 0:
        return new_cache(config)
    heads, head_dim = layout.num_kv_heads, layout.head_dim
    out = fresh_kv((layout.num_layers, 2, 1, heads, tokens, head_dim), dtype)
    pos = 0
    for payload, shape in zip(payloads, shapes):
        take = min(shape[2], tokens - pos)
        if take <= 0:
            break
        src = _as_tensor(payload, dtype, shape)  # (L, 2, T, H, D)
        out[:, :, 0, :, pos:pos + take].copy_(src[:, :, :take].permute(0, 1, 3, 2, 4))
        pos += take
    cache = new_cache(config)
    for layer in range(layout.num_layers):
        dev = layer_device(device, layer)
        cache.update(out[layer, 0].to(dev), out[layer, 1].to(dev), layer)
    return cache

"""The small shim that keeps kvtier_hf working across transformers releases (>= 4.56).

What moves between releases, and how each is bridged here:

- The forward keyword for the KV cache (``past_key_values``; newer code paths call it
  ``cache``) and the optional ``cache_position`` / ``logits_to_keep`` keywords: read from the
  model's ``forward`` signature once, see :class:`ForwardKwargs`.
- Per-layer K/V: ``cache.layers[i].keys / .values`` (>= 4.56) versus the older
  ``cache.key_cache[i] / value_cache[i]`` lists: see :func:`layer_kv`.
- Building a :class:`~transformers.DynamicCache`: ``DynamicCache(config=...)`` where accepted
  (it picks the right layer class per layer), else ``DynamicCache()``; filled through the
  stable ``update(k, v, layer_idx)`` verb, see :func:`new_cache`.

Nothing here holds state; every function is safe to call from any thread.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache, PretrainedConfig

# torch dtype -> kvtier chunk dtype name (kvtier.chunk.DTYPES); the keys of the on-disk format.
TORCH_TO_KV_DTYPE: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}
KV_TO_TORCH_DTYPE: dict[str, torch.dtype] = {v: k for k, v in TORCH_TO_KV_DTYPE.items()}


@dataclass(frozen=True)
class ForwardKwargs:
    """How to call this model's ``forward``: the cache keyword and the optional ones it has."""

    cache: str
    cache_position: bool
    logits_to_keep: str | None

    @classmethod
    def of(cls, model: torch.nn.Module) -> ForwardKwargs:
        params = inspect.signature(model.forward).parameters
        cache = "past_key_values" if "past_key_values" in params else (
            "cache" if "cache" in params else "past_key_values")
        keep = next((n for n in ("logits_to_keep", "num_logits_to_keep") if n in params), None)
        return cls(cache=cache, cache_position="cache_position" in params, logits_to_keep=keep)

    def build(self, input_ids: torch.Tensor, cache: Any, start: int) -> dict[str, Any]:
        """Keyword arguments to run ``input_ids`` (batch 1) at absolute positions from ``start``
        against ``cache``, keeping only the last position's logits when the model allows it."""
        n = input_ids.shape[-1]
        positions = torch.arange(start, start + n, device=input_ids.device)
        kwargs: dict[str, Any] = {
            "input_ids": input_ids,
            self.cache: cache,
            "position_ids": positions.unsqueeze(0),
            "use_cache": True,
        }
        if self.cache_position:
            kwargs["cache_position"] = positions
        if self.logits_to_keep is not None:
            kwargs[self.logits_to_keep] = 1
        return kwargs


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config (multimodal models nest it)."""
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)  # type: ignore[no-any-return]
    except TypeError:  # releases whose get_text_config has no ``decoder`` keyword
        return getter()  # type: ignore[no-any-return]


def new_cache(config: PretrainedConfig | None = None) -> Any:
    """An empty DynamicCache laid out for ``config`` where this release supports that."""
    if config is not None:
        try:
            return DynamicCache(config=config)
        except TypeError:  # releases before DynamicCache took a config
            pass
    return DynamicCache()


def cache_layers(cache: Any) -> int:
    """Number of layers that hold K/V in ``cache``."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return len(layers)
    return len(cache.key_cache)


def layer_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of one layer, each (batch, kv_heads, seq, head_dim); views, not copies."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        entry = layers[layer]
        return entry.keys, entry.values
    return cache.key_cache[layer], cache.value_cache[layer]


def set_layer_kv(cache: Any, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Make ``keys`` / ``values`` (batch, kv_heads, seq, head_dim) layer ``layer``'s K/V as they
    are, without the copy ``cache.update`` makes (it concatenates onto an empty tensor). Layers
    must be set in order, from 0, on a new cache; the cache keeps references to the tensors."""
    # A zero-token update creates and initialises the layer the way this release does...
    cache.update(keys[:, :, :0], values[:, :, :0], layer)
    layers = getattr(cache, "layers", None)
    # ...then the tensors replace its (empty) ones; the next update concatenates onto them.
    if layers is not None:
        layers[layer].keys, layers[layer].values = keys, values
    else:
        cache.key_cache[layer], cache.value_cache[layer] = keys, values


def has_sliding_layers(cache: Any) -> bool:
    """True when some layer keeps only a window of tokens (restoring a long prefix into it
    would not reproduce what the model computes)."""
    return any(bool(getattr(layer, "is_sliding", False)) for layer in getattr(cache, "layers", ()))


def seq_length(cache: Any) -> int:
    return int(cache.get_seq_length())

"""The namespace a vLLM worker's chunks live in: model, revision, KV layout and dtype, TP rank.

Chunks are only ever served within one namespace (kvtier.keys), so everything that changes the
bytes of a chunk must be in it: a non-canonical paged layout (attention backend, ISA, strides)
and a quantized KV cache dtype go into the revision; an MLA latent is the same on every TP rank,
so MLA uses one namespace for all ranks (a shared tier keeps one copy, not one per rank).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.cache import PrefixCache
from kvtier.checkpoint import model_revision
from kvtier.config import KVTierConfig
from kvtier.keys import KVLayout, NamespaceSpec
from kvtier.store import TieredStore

from .blocks import PagedLayout, dtype_name


@dataclass(frozen=True)
class EngineInfo:
    """What the worker needs to know about the engine (gathered by connector.py)."""

    model_id: str
    model_revision: str
    block_size: int
    cache_dtype: str
    rank: int
    world_size: int
    dp_rank: int
    engine_id: str
    backend: str
    isa: str | None
    kv_events: bool
    mla: bool = False  # MLA latent cache: one plane, the same bytes on every TP rank


def engine_revision(model_config: Any) -> str:
    """The revision of the engine's weights when ``model_revision`` is not set: the hub commit
    of the snapshot vLLM loaded (transformers' ``_commit_hash`` of its config: a model updated
    upstream is another namespace, and transformers names the same commit); for a model loaded
    from a local directory a fingerprint of its files (kvtier.checkpoint: a checkpoint saved
    again into the same directory must not be served its predecessor's K/V; transformers
    computes the same one); else vLLM's ``revision``. Plus ``+quant=`` of vLLM's
    ``quantization`` and ``+cfg=`` of ``hf_overrides`` when the engine overrides the saved
    config (other K/V)."""
    commit = getattr(getattr(model_config, "hf_config", None), "_commit_hash", None)
    revision = str(commit or model_revision(str(getattr(model_config, "model", "") or ""),
                                            getattr(model_config, "revision", None) or None))
    quantization = getattr(model_config, "quantization", None)
    if quantization:  # --quantization: other weights in the same files, other KV
        revision += f"+quant={quantization}"
    overrides = getattr(model_config, "hf_overrides", None)
    if overrides:
        named = (f"{overrides.__module__}.{overrides.__qualname__}" if callable(overrides)
                 else json.dumps(overrides, sort_keys=True, default=str))
        revision += "+cfg=" + hashlib.sha256(named.encode()).hexdigest()[:16]
    return revision


def engine_namespace(info: EngineInfo, layout: PagedLayout, first: torch.Tensor, num_layers: int,
                     heads: int, head_dim: int, chunk: int, hash_name: str) -> NamespaceSpec:
    """The namespace of the worker whose first KV cache tensor is ``first``."""
    revision = info.model_revision
    if not layout.canonical:
        revision += f"+kvlayout={info.backend}:{info.isa}:{tuple(first.stride())}"
    if info.cache_dtype not in ("auto", ""):
        revision += f"+kvcache={info.cache_dtype}"
    # Every TP rank of an MLA model holds the same latent: one namespace for all ranks, so a
    # shared tier (disk path, redis, kvtier-server) keeps one copy, not one per rank.
    rank, world = (0, 1) if info.mla else (info.rank, info.world_size)
    return NamespaceSpec(
        model_id=info.model_id,
        layout=KVLayout(num_layers, heads, head_dim, chunk, kv=layout.planes),
        kv_dtype=dtype_name(first.dtype), model_revision=revision, rank=rank,
        world_size=world, hash_name=hash_name)  # type: ignore[arg-type]


def tenant_cache(store: TieredStore, cfg: KVTierConfig, base: NamespaceSpec, salt: bytes) -> PrefixCache:
    """The prefix cache of the tenant whose namespace salt is ``salt`` (settings.namespace_salt;
    empty: no tenant) over the worker's ``store``. Under key schema x1, ``salt`` seeds the page
    chain instead and the namespace salt is ``cfg.salt`` alone, as SGLang's backend names it."""
    x1 = cfg.key_schema == "x1"
    spec = NamespaceSpec(**{**base.__dict__, "salt": cfg.salt if x1 else salt})
    tenant = hashlib.sha256(salt).hexdigest()[:12] if salt else ""
    return PrefixCache(store, spec, codec=cfg.codec, shuffle=cfg.shuffle, tenant=tenant,
                       key_schema=cfg.key_schema, page_seed=(salt or None) if x1 else None)


TENANT_CACHES = 1024  # PrefixCaches kept (per tenant salt), least recently used dropped first


class TenantCaches:
    """A worker's PrefixCache per tenant salt, most recently used kept: bounded, since
    ``cache_salt`` may be per user or per conversation (a PrefixCache is cheap to make again:
    it holds no chunk state). Thread-safe (the forward, saver and prefetch threads ask)."""

    def __init__(self) -> None:
        self._caches: OrderedDict[bytes, PrefixCache] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, salt: bytes, make: Callable[[], PrefixCache]) -> PrefixCache:
        with self._lock:
            cache = self._caches.get(salt)
            if cache is None:
                cache = self._caches[salt] = make()
                if len(self._caches) > TENANT_CACHES:
                    self._caches.popitem(last=False)
            else:
                self._caches.move_to_end(salt)
            return cache

    def __len__(self) -> int:
        return len(self._caches)

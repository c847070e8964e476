"""Who may share a page: SGLang's storage config + host pool geometry -> kvtier namespace.

The namespace (kvtier/keys.py) hashes model id and revision, KV dtype, the canonical page
shape (layers, kv, heads, head_dim, page tokens), the parallel rank/size and the configured
salt. SGLang's keys are always the x1 page chain (the backend never sees tokens); with
``key_schema: x1`` in the config (one config shared by every engine) ``chunk_tokens`` must
equal SGLang's page size, else ConfigError; with the default ``v1`` it does not apply.
Not in it: the host layout, because pages are stored in canonical order (pages.py), so
instances with different ``--hicache-mem-layout`` (and other engines) share pages.

Ranks: an MHA page on TP rank r holds only r's heads, so rank = ``pp_rank * tp_size +
tp_rank`` of ``pp_size * tp_size``. An MLA latent is the same on every TP rank: one copy,
rank = ``pp_rank`` of ``pp_size``, written by the storage writer rank only. Tenants: SGLang
seeds its page chain with the request's ``extra_key`` / ``cache_salt`` (kvtier.keys.
page_hash_seed), so different tenants never produce the same page hash, and ``salt_hex``
separates whole deployments on a shared cluster.

Pure: imports no SGLang (the storage config is duck-typed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from typing import Any

import torch

from kvtier.checkpoint import model_revision
from kvtier.chunk import HEADER_SIZE
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, KVLayout, NamespaceSpec, xengine_key

from .pages import PageGeometry
from .settings import SglangSettings

log = logging.getLogger(__name__)

TORCH_TO_KV_DTYPE = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                     torch.float32: "float32", torch.float8_e4m3fn: "float8_e4m3fn",
                     torch.float8_e5m2: "float8_e5m2", torch.uint8: "uint8", torch.int8: "int8"}


def check_supported(storage_config: Any) -> None:
    """Refuse parallel set-ups whose pages are not whole canonical pages (ConfigError)."""
    if getattr(storage_config, "should_split_heads", False):
        raise ConfigError("tp_lcm_size: head-split pages (heterogeneous TP) are not supported "
                          "by kvtier_sglang; drop tp_lcm_size from the extra config")
    for name in ("attn_cp_size", "dcp_size"):
        if int(getattr(storage_config, name, 1) or 1) > 1:
            raise ConfigError(f"{name}: context-parallel KV shards are not supported by "
                              f"kvtier_sglang (got {getattr(storage_config, name)})")


#: SGLang's ``--kv-cache-dtype`` names of the fp8 formats it keeps in uint8 buffers.
SGLANG_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def _served_kv_cache_dtype() -> str:
    """The running server's ``--kv-cache-dtype`` where SGLang's runtime context has one, else
    "" (a CPU harness with no server, or a version that keeps it elsewhere)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(getattr(get_server_args(), "kv_cache_dtype", "") or "")
    except (ImportError, AttributeError, RuntimeError, ValueError):  # ValueError: not set yet
        return ""


def kv_dtype_of(geo: PageGeometry, settings: SglangSettings) -> str:
    """The namespace's KV dtype. SGLang keeps fp8 KV (e4m3 and e5m2 alike) in uint8 buffers, so
    the host pool's dtype cannot tell them apart, and two instances with different fp8 formats
    would read each other's pages as their own (found by an audit: an e5m2 instance restored
    e4m3 bytes). For a uint8 pool the dtype comes from ``sglang.kv_dtype``, else from the
    server's ``--kv-cache-dtype``; with neither, the attach is refused. ConfigError otherwise
    too where the setting contradicts the pool."""
    pool = TORCH_TO_KV_DTYPE.get(geo.dtype)
    if pool is None:
        raise ConfigError(f"host pool dtype {geo.dtype} has no kvtier KV dtype; "
                          f"supported: {sorted(TORCH_TO_KV_DTYPE.values())}")
    named = settings.kv_dtype
    if named and named not in TORCH_TO_KV_DTYPE.values():
        raise ConfigError(f"sglang.kv_dtype: {named!r} is not one of {sorted(TORCH_TO_KV_DTYPE.values())}")
    if geo.dtype != torch.uint8:
        if named and named != pool:
            raise ConfigError(f"sglang.kv_dtype: {named!r}, but the host pool holds {pool} KV")
        return pool
    if named:
        return named
    served = SGLANG_FP8.get(_served_kv_cache_dtype())
    if served is None:
        raise ConfigError("sglang.kv_dtype: the host pool holds KV as uint8, which is how SGLang "
                          "keeps every fp8 format, so the pages do not say which; set it to the "
                          "--kv-cache-dtype in use (float8_e4m3fn for fp8_e4m3, float8_e5m2 for "
                          "fp8_e5m2), so that instances with other formats never share pages")
    return served


def namespace_spec(storage_config: Any, geo: PageGeometry, cfg: KVTierConfig,
                   settings: SglangSettings) -> NamespaceSpec:
    """The namespace of this rank's pages (see the module docstring)."""
    model_id = settings.model_id or (storage_config.model_name or "")
    if not model_id:
        raise ConfigError("sglang.model_id: SGLang passed no model_name; set sglang.model_id "
                          "in the extra config to name the namespace")
    dtype = kv_dtype_of(geo, settings)
    if cfg.key_schema == "x1" and cfg.chunk_tokens != geo.page_tokens:
        raise ConfigError(f"chunk_tokens: {cfg.chunk_tokens} with key_schema x1 is the page size "
                          f"every engine sharing the cache keys by, but this SGLang instance has "
                          f"--page-size {geo.page_tokens}; run SGLang with --page-size "
                          f"{cfg.chunk_tokens} or set chunk_tokens to {geo.page_tokens} everywhere")
    pp_rank, pp_size = int(storage_config.pp_rank), int(storage_config.pp_size)
    if geo.is_mla:
        rank, world = pp_rank, pp_size
    else:
        tp_rank, tp_size = int(storage_config.tp_rank), int(storage_config.tp_size)
        rank, world = pp_rank * tp_size + tp_rank, pp_size * tp_size
    layout = KVLayout(num_layers=geo.layers, num_kv_heads=geo.heads, head_dim=geo.head_dim,
                      chunk_tokens=geo.page_tokens, kv=geo.kv)
    # SGLang names no revision: a hub model's is the commit of its cached snapshot, a local
    # directory's the fingerprint of its files (kvtier.checkpoint.model_revision; the same
    # transformers and vLLM compute), so updated weights are never served the old pages.
    revision = settings.model_revision or model_revision(str(storage_config.model_name or ""))
    return NamespaceSpec(model_id=model_id, layout=layout, kv_dtype=dtype,
                         model_revision=revision, rank=rank, world_size=world,
                         salt=cfg.salt, hash_name="sha256")


def fit_slots(cfg: KVTierConfig, geo: PageGeometry) -> KVTierConfig:
    """``cfg`` with ``cpu.slot_bytes`` raised to hold one page chunk when it is smaller (a page
    larger than a slot would be refused on every put: a cache that never hits)."""
    need = -(-(HEADER_SIZE + geo.page_bytes) // 4096) * 4096
    if not cfg.cpu.enabled or cfg.cpu.slot_bytes >= need:
        return cfg
    log.info("cpu.slot_bytes %d < one page chunk (%d bytes): using %d", cfg.cpu.slot_bytes, need, need)
    cpu = dataclasses.replace(cfg.cpu, slot_bytes=need, capacity_bytes=max(cfg.cpu.capacity_bytes, need))
    return dataclasses.replace(cfg, cpu=cpu)


def page_hash_bytes(key: str) -> bytes:
    """SGLang hands page keys as hex SHA-256 strings; anything else (a backend-specific key
    from another caller) is hashed, so every key maps to 32 bytes deterministically."""
    if len(key) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(key)
        except ValueError:
            pass
    return hashlib.sha256(key.encode()).digest()


def store_keys(namespace: bytes, keys: list[str]) -> list[bytes]:
    """kvtier x1 keys of SGLang page keys."""
    return [xengine_key(namespace, page_hash_bytes(k)) for k in keys]

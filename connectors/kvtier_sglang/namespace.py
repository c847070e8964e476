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

Weights: the model id is SGLang's ``model_name``, which is ``--served-model-name`` when given,
so it does not tell checkpoints apart; the revision comes from the checkpoint the server loaded
(``--model-path``, ``--revision``: served.py), so two checkpoints served under one name never
share pages.

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
from .served import served_kv_cache_dtype, served_model, served_nnodes
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
    served = SGLANG_FP8.get(served_kv_cache_dtype() or "")
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
    return NamespaceSpec(model_id=model_id, layout=layout, kv_dtype=dtype,
                         model_revision=weights_revision(storage_config, settings),
                         rank=rank, world_size=world,
                         salt=cfg.salt, hash_name="sha256")


def weights_revision(storage_config: Any, settings: SglangSettings) -> str:
    """The namespace's model revision: ``sglang.model_revision`` when set; else that of the
    checkpoint the server loaded (``--model-path`` at ``--revision``; served.py); else, where
    no server configuration is published, that of SGLang's ``model_name``. A hub id's is the
    commit of its cached snapshot, a local directory's the fingerprint of its files
    (kvtier.checkpoint.model_revision: what transformers and vLLM compute), so updated weights
    are never served the old pages. ``model_name`` alone is not enough: it is
    ``--served-model-name`` when given, and two checkpoints served under one name shared pages
    (found by an audit). "" (with a warning) where nothing names the weights."""
    if settings.model_revision:
        return settings.model_revision
    served = served_model()
    if served is not None:
        source, revision = served.path, model_revision(served.path, served.revision)
    else:
        source = str(storage_config.model_name or "")
        revision = model_revision(source)
    if not revision:
        log.warning("sglang.model_revision: nothing names the weights of %r (neither a local "
                    "directory nor a Hugging Face hub id in the local cache, and no --revision): "
                    "pages are keyed by the model id alone, so other weights served under the same "
                    "id would share them; set sglang.model_revision", source)
    return revision


def check_rank_sharing(storage_config: Any, cfg: KVTierConfig) -> None:
    """Refuse (ConfigError) an MLA model with ``tp_size`` > 1 on a store no TP rank shares.

    Why: an MLA latent is the same on every TP rank, so SGLang's controller backs a page up on
    its storage-writer rank alone (``backup_skip`` on the others) and MIN-reduces the per-rank
    ``batch_exists`` over the TP group. With only the process-local cpu tier the other ranks
    never hold a page and the reduced hit is 0 forever: L3 that stores and never serves. A
    local disk is shared by the ranks of one host; where the server spans hosts (``--nnodes``
    > 1) and disk is the only shared tier, the path must be a filesystem every host mounts:
    warned, not refused (a network filesystem is a valid set-up)."""
    tp_size = int(storage_config.tp_size)
    if not storage_config.is_mla_model or tp_size <= 1:
        return
    if not (cfg.disk.enabled or cfg.redis.enabled or cfg.grpc.enabled):
        raise ConfigError(
            f"disk.enabled / redis.enabled / grpc.enabled: an MLA model with tp_size {tp_size} needs "
            f"a tier its TP ranks share: SGLang stores each page from its storage-writer rank "
            f"alone, so with only the process-local cpu tier the other ranks never hold it and "
            f"the TP-wide hit is always 0. Enable disk (shared by the ranks of one host), redis "
            f"or grpc (kvtier-server) in --hicache-storage-backend-extra-config")
    nnodes = served_nnodes()
    if nnodes is not None and nnodes > 1 and not (cfg.redis.enabled or cfg.grpc.enabled):
        log.warning("disk.path: an MLA model with tp_size %d on %d nodes writes each page from one "
                    "rank; ranks on other hosts hit only if %s is a filesystem every host shares "
                    "(else enable redis or grpc)", tp_size, nnodes, cfg.disk.path)


def fit_slots(cfg: KVTierConfig, geo: PageGeometry, *, slot_named: bool) -> KVTierConfig:
    """``cfg`` with ``cpu.slot_bytes`` fitted to this pool's page chunk (header + page, rounded
    up to 4 KiB). The cpu tier keeps one chunk per slot whatever its length: slots much larger
    than a page waste the rest (at ``--page-size 1`` the 4 MiB default held 2 KiB pages, 256 in
    a 1 GiB tier, while ``batch_set_v1`` reported every page stored), and a page larger than a
    slot is refused on every put (a cache that never hits).
    ``slot_named`` False (cpu.slot_bytes not set anywhere: settings.slot_bytes_named): one slot
    is one page chunk. True: the value is raised to one page chunk when smaller, kept
    otherwise, with a warning when more than half of each slot would stay unused."""
    if not cfg.cpu.enabled:
        return cfg
    chunk = HEADER_SIZE + geo.page_bytes
    need = -(-chunk // 4096) * 4096
    slot = cfg.cpu.slot_bytes
    if slot_named and slot >= need:
        if chunk < slot // 2:
            log.warning("cpu.slot_bytes: %d-byte slots hold %d-byte page chunks, leaving %d%% of "
                        "each unused (the tier keeps %d pages); leave cpu.slot_bytes unset to size "
                        "slots to one page (%d bytes)", slot, chunk, 100 * (slot - chunk) // slot,
                        cfg.cpu.capacity_bytes // slot, need)
        return cfg
    if slot_named:
        log.info("cpu.slot_bytes %d < one page chunk (%d bytes): using %d", slot, chunk, need)
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

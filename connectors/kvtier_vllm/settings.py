"""Connector configuration: ``kv_connector_extra_config`` -> (KVTierConfig, VllmSettings).

The extra config is a plain dict. Its ``vllm`` section (optional) holds the connector's own
settings below; every other key is kvtier configuration handed to
``KVTierConfig.load(overrides=...)`` (so ``KVTIER_*`` environment variables apply underneath,
and ``config_file`` names an optional YAML file). Every invalid value raises
:class:`kvtier.errors.ConfigError` at engine start, naming the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.config import KVTierConfig, from_dict
from kvtier.errors import ConfigError
from kvtier.keys import page_hash_seed, tenant_salt

GiB = 1 << 30


def _rng(lo: float | None, hi: float | None, *, size: bool = False) -> dict[str, Any]:
    # Same metadata shape kvtier.config's validator reads.
    return {"range": (lo, hi), "size": size}


@dataclass(frozen=True)
class VllmSettings:
    """The ``vllm`` section of ``kv_connector_extra_config``."""

    # Namespace identity; default: vLLM's model name / revision. Set model_id when replicas load
    # the same weights from different paths, or they will not share a namespace.
    model_id: str = ""
    model_revision: str = ""
    load: bool = True                   # restore hits into the engine
    save: bool = True                   # save newly computed full chunks
    save_decode: bool = True            # also save chunks made of generated tokens
    # "auto": async (load_async=True) only when a hit sits below the fast (in-memory) tiers and
    # its estimated load time (loadplan.py) is at least async_min_load_s: a shorter load costs
    # less inline, overlapped layer by layer with the forward, than the engine steps an async
    # load adds (it waits in WAITING_FOR_REMOTE_KVS for at least two more engine steps).
    async_load: str = field(default="auto", metadata={"choices": ("auto", "always", "never")})
    async_min_load_s: float = field(default=0.01, metadata=_rng(0, 3600))
    # A synchronous restore not done this long after its step began is given up (its blocks
    # reported failed, vLLM recomputes): a stalled store must never hold the forward pass.
    sync_load_timeout_s: float = field(default=2.0, metadata=_rng(0.01, 3600))
    # An async load not done this long after it was queued is given up the same way: its
    # request stops waiting in WAITING_FOR_REMOTE_KVS and recomputes (asyncloads.py).
    async_load_timeout_s: float = field(default=10.0, metadata=_rng(0.01, 3600))
    prefetch: bool = True               # start loading at lookup time
    # "auto": load only the leading part of a hit estimated faster to load than to recompute
    # (per-tier bandwidth and fixed cost, and the engine's prefill rate, measured online:
    # loadplan.py); "always": load every hit.
    load_decision: str = field(default="auto", metadata={"choices": ("auto", "always")})
    reprobe_s: float = field(default=10.0, metadata=_rng(0, 86400))  # re-measure a skipped tier
    # ... no more often than keeps its probes' cost within this share of the time (loadplan.py)
    probe_share: float = field(default=0.02, metadata=_rng(1e-4, 1))
    prefill_prior_tokens_per_s: float = field(default=5000.0, metadata=_rng(1, None))  # until measured
    prefetch_max_bytes: int = field(default=1 * GiB, metadata=_rng(0, None, size=True))
    prefetch_workers: int = field(default=2, metadata=_rng(1, 64))
    lookup_timeout_s: float = field(default=0.5, metadata=_rng(0.001, 60))
    lookup_cache_s: float = field(default=1.0, metadata=_rng(0, 3600))
    save_queue_depth: int = field(default=64, metadata=_rng(1, 100_000))
    # Host staging for captured chunks, preallocated once (pinned on GPU hosts); when it is
    # full the chunks that do not fit are not saved (counted as dropped saves).
    save_staging_bytes: int = field(default=2 * GiB, metadata=_rng(0, None, size=True))
    # Host buffers restores read chunks into, preallocated once (pinned on GPU hosts) so the
    # host-to-device copies are asynchronous; a load that finds it short reads into pageable
    # memory instead (counted as load_pageable_chunks). Also bounds what prefetches hold.
    restore_staging_bytes: int = field(default=1 * GiB, metadata=_rng(0, None, size=True))
    # Block-granular hits (partial.py): save a prefix's block-aligned tail past its last full
    # chunk as a partial chunk, and probe up to partial_probes of them per lookup (0: off).
    save_partial: bool = True
    partial_probes: int = field(default=16, metadata=_rng(0, 1024))
    socket_dir: str = ""
    metrics_port: int = field(default=0, metadata=_rng(0, 65535))  # 0: no HTTP /metrics
    # KV events (only when vLLM's kv_events_config enables them; events.py): chunk keys
    # buffered per step in the worker, events buffered between take_events calls, and chunks
    # the scheduler keeps descriptions of (token ids, vLLM block hashes: ~1.2 KiB each).
    events_queue_keys: int = field(default=100_000, metadata=_rng(1, None))
    events_tracked_chunks: int = field(default=16_384, metadata=_rng(1, None))


def load_settings(extra: Mapping[str, Any] | None) -> tuple[KVTierConfig, VllmSettings]:
    """Split and validate ``kv_connector_extra_config``; raises ConfigError."""
    data = dict(extra or {})
    section = data.pop("vllm", {}) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"vllm: expected a mapping of connector settings, got {section!r}")
    path = data.pop("config_file", None)
    settings = from_dict(VllmSettings, section, prefix="vllm.")
    cfg = KVTierConfig.load(path, overrides=data)  # validates salt_hex among the rest
    return cfg, settings


def check_block_size(cfg: KVTierConfig, block_size: int) -> None:
    """A chunk is whole blocks. With ``key_schema: x1`` a chunk is also one SGLang page, so the
    SGLang instances sharing the cache run ``--page-size`` = ``chunk_tokens`` (their backend
    refuses any other page size with a ConfigError, kvtier_sglang.namespace)."""
    if cfg.chunk_tokens % block_size:
        raise ConfigError(
            f"chunk_tokens: {cfg.chunk_tokens} is not a multiple of vLLM's block size "
            f"{block_size}; use e.g. {max(1, cfg.chunk_tokens // block_size) * block_size}")


def namespace_salt(cfg: KVTierConfig, cache_salt: str | None) -> bytes:
    """Per-request namespace salt (see docs/vllm.md, "Tenants").

    tenant = the request's ``cache_salt`` or ``cfg.tenant``. With ``salt_hex`` configured it is a
    server secret: salt = HMAC-SHA256(secret, tenant) (or the secret itself for no tenant);
    without it the salt is the tenant's UTF-8 bytes (empty: the shared namespace).
    With ``key_schema: x1`` the namespace salt is ``salt_hex`` alone and the tenant seeds the
    page chain instead, as SGLang seeds it with a request's ``cache_salt``: the value returned is
    that seed (``kvtier.keys.page_hash_seed(None, tenant)``; empty: the shared chain), so a vLLM
    and an SGLang request with the same ``cache_salt`` share pages and other tenants do not.
    """
    tenant = cache_salt or cfg.tenant
    if cfg.key_schema == "x1":
        return page_hash_seed(None, tenant) or b""
    secret = cfg.salt
    if not tenant:
        return secret
    return tenant_salt(secret, tenant) if secret else tenant.encode()


def request_salt(cfg: KVTierConfig, request: Any) -> bytes | None:
    """The salt of ``request``'s chunks: :func:`namespace_salt` of its ``cache_salt``, extended
    by its LoRA adapter (name and path, as vLLM's own block hashes take them: an adapter's KV
    is not the base model's, nor another adapter's). None when token ids do not determine the
    request's KV at all (multimodal inputs, prompt embeddings, whose token ids vLLM sets to
    placeholders): such a request is neither looked up nor saved."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    salt = namespace_salt(cfg, getattr(request, "cache_salt", None))
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return salt
    adapter = f"{lora.lora_name}\0{getattr(lora, 'lora_path', '') or ''}".encode()
    return hashlib.sha256(b"kvtier/lora\0" + adapter + b"\0" + salt).digest()

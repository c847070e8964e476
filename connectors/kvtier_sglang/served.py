"""What the running SGLang server says about itself, where SGLang's storage config does not.

The backend's ``HiCacheStorageConfig`` carries ``model_name`` (the ``--served-model-name``, not
the checkpoint), and SGLang pops some of its own extra-config keys before the backend sees
them. The process's published server configuration (``sglang.srt.runtime_context``) has the
rest: the checkpoint path and revision, ``--kv-cache-dtype``, the node count, and the raw
``--hicache-storage-backend-extra-config``.

Contract: every reader returns ``None`` where nothing is published (a harness that builds a
controller by hand, a version that keeps it elsewhere): the caller decides what unknown means.
SGLang is imported lazily, so this module imports without SGLang installed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: SGLang's extra-config flag that makes it pass ``HiCacheStorageExtraInfo.prefix_keys``.
PASS_PREFIX_KEYS = "hicache_storage_pass_prefix_keys"

# Raised by SGLang's accessors before publication (ValueError: "... not published", "Global
# server args is not set yet!") or for a leaf a version does not have (AttributeError).
_UNPUBLISHED = (ImportError, AttributeError, ValueError)


@dataclass(frozen=True)
class ServedModel:
    """The checkpoint the server loaded: ``--model-path`` (after SGLang resolved it, e.g. a Hub
    GGUF reference to a local file) and ``--revision``."""

    path: str
    revision: str | None


def _model_bag() -> Any:
    from sglang.srt.runtime_context import get_model

    return get_model()


def served_model() -> ServedModel | None:
    """The loaded checkpoint, or None where no server configuration is published."""
    try:
        bag = _model_bag()
        path, revision = bag.model_path, bag.revision
    except _UNPUBLISHED:
        return None
    if not path:
        return None
    return ServedModel(str(path), str(revision) if revision else None)


def served_kv_cache_dtype() -> str | None:
    """The server's ``--kv-cache-dtype`` (e.g. ``fp8_e4m3``, ``auto``), or None."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().kv_cache_dtype or "")
    except _UNPUBLISHED:
        return None


def served_nnodes() -> int | None:
    """``--nnodes`` of the server, or None."""
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().nnodes)
    except _UNPUBLISHED:
        return None


def served_pass_prefix_keys() -> bool | None:
    """Whether the server was started with ``hicache_storage_pass_prefix_keys`` on, read the
    way SGLang reads it (its own parser, so ``@file`` configs count too); None where the server
    has no extra config published (e.g. a backend attached later through the admin API)."""
    try:
        from sglang.srt.runtime_context import get_memory

        raw = get_memory().hicache_storage_backend_extra_config
    except _UNPUBLISHED:
        return None
    if not raw:
        return None
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    try:
        return bool(HybridCacheController.parse_storage_backend_extra_config(raw)[4])
    except (OSError, ValueError):  # SGLang read it at start; a config file gone since: unknown
        return None


def pass_prefix_keys(storage_config: Any) -> bool | None:
    """Whether SGLang passes prefix keys to this backend: the flag in the extra config when it
    is still there (a controller built by hand; SGLang's server pops it), else the server's."""
    extra = getattr(storage_config, "extra_config", None) or {}
    if PASS_PREFIX_KEYS in extra:
        return extra[PASS_PREFIX_KEYS] is True
    return served_pass_prefix_keys()

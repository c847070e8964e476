"""Backend configuration: SGLang's ``--hicache-storage-backend-extra-config`` -> settings.

The extra config is one JSON dict. SGLang's own keys (``backend_name``, ``module_path``,
``class_name``, ``interface_v1``, ``tp_lcm_size``) are read by SGLang and ignored here; an
optional ``sglang`` section holds this backend's settings (below); every other key is kvtier
configuration for ``KVTierConfig.load(overrides=...)`` (``config_file`` names a YAML file,
``KVTIER_*`` environment variables apply underneath). Invalid values raise
:class:`kvtier.errors.ConfigError` naming the field, at attach time (SGLang refuses to start).

Pure: imports no SGLang, so the main test environment checks it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig, from_dict
from kvtier.config_sources import env_to_dict, read_yaml
from kvtier.errors import ConfigError

# Keys of the extra config that SGLang itself consumes (factory loader, controller, and the
# tree cache's parse_storage_backend_extra_config, which a server pops before the backend sees
# the dict but a controller built directly leaves in; file_storage_path: --file-storage-path).
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1",
                         "tp_lcm_size", "enable_metadata_cache", "metadata_ttl",
                         "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys", "file_storage_path"})


@dataclass(frozen=True)
class SglangSettings:
    """The ``sglang`` section of the extra config.

    ``model_id`` / ``model_revision`` name the namespace (default: SGLang's ``model_name``, which
    carries the host pool's format tag when it has one, and the revision of the checkpoint the
    server loaded: namespace.weights_revision). Set them to the id the other engines'
    connectors use (kvtier_hf ``model_id``, kvtier_vllm ``vllm.model_id``) to share one cache.
    ``load`` / ``save`` switch the read and write halves off (``batch_exists`` then reports 0 /
    ``batch_set_v1`` stores nothing but reports success). ``kv_dtype``: the KV dtype for the
    namespace where the host pool does not tell it (SGLang keeps every fp8 KV format in uint8
    buffers; kvtier_sglang.namespace.kv_dtype_of), e.g. ``float8_e4m3fn`` or ``float8_e5m2``.
    """

    model_id: str = ""
    model_revision: str = ""
    kv_dtype: str = ""
    load: bool = True
    save: bool = True


def load_settings(extra: Mapping[str, Any] | None) -> tuple[KVTierConfig, SglangSettings]:
    """Split and validate the extra config; raises ConfigError naming the bad field."""
    data = {k: v for k, v in dict(extra or {}).items() if k not in SGLANG_KEYS}
    section = data.pop("sglang", {}) or {}
    if not isinstance(section, Mapping):
        raise ConfigError(f"sglang: expected a mapping of backend settings, got {section!r}")
    path = data.pop("config_file", None)
    settings = from_dict(SglangSettings, section, prefix="sglang.")
    cfg = KVTierConfig.load(path, overrides=data)
    return cfg, settings


def slot_bytes_named(extra: Mapping[str, Any] | None) -> bool:
    """Whether ``cpu.slot_bytes`` is set by any source ``load_settings`` reads (the extra
    config, its ``config_file``, ``KVTIER_CPU__SLOT_BYTES``), as opposed to the default: the
    backend sizes unset slots to one page (namespace.fit_slots) but keeps a chosen value.
    Call after ``load_settings`` accepted ``extra`` (the sources are valid then)."""
    data = dict(extra or {})
    path = data.get("config_file")
    sources = [data, env_to_dict(os.environ)]
    if path is not None:
        sources.append(read_yaml(Path(path)))
    for source in sources:
        cpu = source.get("cpu")
        if isinstance(cpu, Mapping) and "slot_bytes" in cpu:
            return True
    return False

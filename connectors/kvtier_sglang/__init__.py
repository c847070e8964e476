"""kvtier as SGLang's HiCache L3 storage backend (docs/sglang.md).

Loaded by SGLang's ``dynamic`` storage backend factory, configured not patched::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"kvtier","module_path":"kvtier_sglang","class_name":"KVTierStorage",
        "interface_v1":1,"cpu":{"capacity_bytes":"8GiB"},"sglang":{"model_id":"..."}}'

``KVTierStorage`` is imported on first access (the factory's ``getattr``), so the engine-neutral
modules (``xengine``, ``pages``, ``settings``) import without SGLang installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierStorage"]


def __getattr__(name: str) -> Any:
    if name == "KVTierStorage":
        from .storage import KVTierStorage

        return KVTierStorage
    raise AttributeError(f"module 'kvtier_sglang' has no attribute {name!r}")

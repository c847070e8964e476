"""kvtier's vLLM connector: ``kv_connector_module_path="kvtier_vllm"``, class ``KVTierConnector``.

``KVTierConnector`` is imported lazily, so the pure modules (``blocks``, ``ipc``, ``settings``)
stay importable, and testable, without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from .connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module 'kvtier_vllm' has no attribute {name!r}")

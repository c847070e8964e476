"""kvtier for transformers: restore a cached prefix into a DynamicCache, prefill only the rest.

See docs/hf.md. ``KVTierHF`` is the entry point; ``kvtier_hf.random_llama`` builds a
random-weight Llama for tests and ``kvtier demo`` (``kvtier_hf.demo``; no download needed).

The public names are imported on first use (PEP 562), so that importing a light submodule
such as ``kvtier_hf.demo_cli`` (the ``kvtier`` CLI does, for ``--help``) does not load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier_hf.connector import (
        GenerationResult,
        KVTierHF,
        RestoredPrefix,
        chunk_nbytes,
        fit_config,
        namespace_for,
    )

__all__ = ["GenerationResult", "KVTierHF", "RestoredPrefix", "chunk_nbytes", "fit_config",
           "namespace_for"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from kvtier_hf import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvtier_hf' has no attribute {name!r}")

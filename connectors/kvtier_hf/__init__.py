"""kvtier for transformers: restore a cached prefix into a DynamicCache, prefill only the rest.

See docs/hf.md. ``KVTierHF`` is the entry point; ``kvtier_hf.testing`` builds a random-weight
Llama for tests and ``kvtier demo`` (no download needed).
"""

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

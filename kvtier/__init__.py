"""kvtier: a tiered, distributed KV-cache store for LLM inference engines."""

from kvtier.errors import ChunkError, ConfigError, KVTierError, TierUnavailableError
from kvtier.keys import KVLayout, NamespaceSpec, chunk_keys, namespace_id, tenant_salt

__version__ = "0.1.0"
__all__ = [
    "ChunkError", "ConfigError", "KVTierError", "TierUnavailableError",
    "KVLayout", "NamespaceSpec", "chunk_keys", "namespace_id", "tenant_salt", "__version__",
]

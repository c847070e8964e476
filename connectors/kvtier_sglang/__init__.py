"""kvtier as SGLang's HiCache L3 storage backend (docs/sglang.md).

Loaded by SGLang's ``dynamic`` storage backend factory, configured not patched::

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
      '{"backend_name":"kvtier","module_path":"kvtier_sglang","class_name":"KVTierStorage",
        "interface_v1":1,"cpu":{"capacity_bytes":"8GiB"},"sglang":{"model_id":"..."}}'
"""

from .storage import KVTierStorage

__all__ = ["KVTierStorage"]

"""Regenerate tests/vectors/keys_x1.json from kvtier.keys (only when schema kvtier/x1 changes).

    python scripts/gen_xengine_vectors.py > tests/vectors/keys_x1.json
"""

from __future__ import annotations

import json

from kvtier.keys import (
    KVLayout,
    NamespaceSpec,
    namespace_id,
    page_hash_seed,
    page_hashes,
    xengine_keys,
)

CASES = [
    dict(model_id="meta-llama/Llama-3.1-8B", model_revision="main", kv_dtype="bfloat16",
         layout=dict(num_layers=32, num_kv_heads=8, head_dim=128, chunk_tokens=4, kv=2),
         rank=0, world_size=1, salt_hex="", extra_key=None, cache_salt=None,
         tokens=list(range(10))),
    dict(model_id="Qwen/Qwen2-0.5B", model_revision="", kv_dtype="float16",
         layout=dict(num_layers=24, num_kv_heads=2, head_dim=64, chunk_tokens=3, kv=2),
         rank=1, world_size=2, salt_hex="00ff", extra_key=None, cache_salt="tenant-a",
         tokens=[0, 1, 2**32 - 1, 128000, 7, 7, 7]),
    dict(model_id="deepseek-ai/DeepSeek-V3", model_revision="r1", kv_dtype="float8_e4m3fn",
         layout=dict(num_layers=61, num_kv_heads=1, head_dim=576, chunk_tokens=64, kv=1),
         rank=0, world_size=1, salt_hex="", extra_key="lora-7", cache_salt="",
         tokens=list(range(130))),
    dict(model_id="tiny", model_revision="", kv_dtype="float32",
         layout=dict(num_layers=1, num_kv_heads=1, head_dim=1, chunk_tokens=2, kv=2),
         rank=0, world_size=1, salt_hex="", extra_key="", cache_salt=None, tokens=[5]),
]


def main() -> None:
    out = []
    for case in CASES:
        spec = NamespaceSpec(case["model_id"], KVLayout(**case["layout"]), case["kv_dtype"],
                             case["model_revision"], case["rank"], case["world_size"],
                             bytes.fromhex(case["salt_hex"]))
        ns = namespace_id(spec)
        page = spec.layout.chunk_tokens
        seed = page_hash_seed(case["extra_key"], case["cache_salt"])
        out.append({**case, "schema": "kvtier/x1", "namespace_hex": ns.hex(),
                    "seed_hex": seed.hex() if seed else "",
                    "page_hashes_hex": [p.hex() for p in page_hashes(case["tokens"], page, seed)],
                    "keys_hex": [k.hex() for k in xengine_keys(ns, case["tokens"], page, seed)]})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

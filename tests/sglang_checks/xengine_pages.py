"""SGLang's side of the vLLM <-> SGLang cross-engine test (tests/test_sglang_crossengine.py).

Runs in the SGLang venv as a script (SGLang and vLLM cannot share a process or an
environment); the two engines meet on one kvtier disk tier, schema ``kvtier/x1``. SGLang's real
classes only: the ``dynamic`` StorageBackendFactory with the extra-config dict a server would
get, a real ``MHATokenToKVPoolHost`` (``layer_first``: its ``kv_buffer`` is ``(2, L, slots, H,
D)``, so a page is indexed here without kvtier's page views) and SGLang's own page hashes.

    python xengine_pages.py read  JOB.json   # restore the prompt's pages; compare with vLLM's blocks
    python xengine_pages.py write JOB.json   # back up the given pages from the host pool

JOB: {"disk", "model_id", "revision", "page", "layers", "heads", "head_dim", "tokens", and
``kv``: for read, the vLLM worker's paged KV tensors (torch.save'd list, one per layer, vLLM
0.32 CPU layout ``[blocks, H, N, 2*D]``: per (block, head) K transposed ``[D, N]`` then V
``[N, D]``); for write, the pages ``(n, L, 2, P, H, D)`` to store}. Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from pools import mha_pools, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str


def backend(job: dict[str, Any], npages: int) -> tuple[Any, Any]:
    _, host = mha_pools("layer_first", page=job["page"], heads=job["heads"], head_dim=job["head_dim"],
                        layers=job["layers"], size=max(npages, 1) * job["page"], dtype=torch.float32)
    extra = {"key_schema": "x1", "chunk_tokens": job["page"], "cpu": {"enabled": False},
             "disk": {"enabled": True, "path": job["disk"]},
             "sglang": {"model_id": job["model_id"], "model_revision": job["revision"]}}
    be = StorageBackendFactory.create_backend("dynamic", storage_config("layer_first", extra), host)
    be.register_mem_pool_host(host)
    return be, host


def host_page(host: Any, slot: int, page: int) -> torch.Tensor:
    """(L, 2, P, H, D) of the host page at ``slot``, straight from SGLang's layer_first buffer."""
    return host.kv_buffer[:, :, slot:slot + page].permute(1, 0, 2, 3, 4)


def vllm_blocks(caches: list[torch.Tensor], head_dim: int) -> torch.Tensor:
    """(blocks, L, 2, N, H, D) from vLLM 0.32's CPU paged tensors (layout in the docstring)."""
    out = []
    for t in caches:
        blocks, heads, n, two_d = t.shape
        if two_d != 2 * head_dim:
            raise SystemExit(f"vLLM cache shape {tuple(t.shape)} is not [B, H, N, 2*D={2 * head_dim}]")
        rows = t.reshape(blocks, heads, n * two_d)
        k = rows[:, :, :head_dim * n].reshape(blocks, heads, head_dim, n).permute(0, 3, 1, 2)
        v = rows[:, :, head_dim * n:].reshape(blocks, heads, n, head_dim).permute(0, 2, 1, 3)
        out.append(torch.stack([k, v], 1))
    return torch.stack(out, 1)


def read(job: dict[str, Any]) -> dict[str, Any]:
    page, tokens = job["page"], job["tokens"]
    keys = get_storage_hash_str(tokens, None, page_size=page)
    be, host = backend(job, len(keys))
    try:
        n = be.batch_exists(keys)
        dst = host.alloc(n * page)
        ok = be.batch_get_v1(keys[:n], dst) if n else []
        blocks = vllm_blocks(torch.load(job["kv"]), job["head_dim"])
        per_block = blocks.shape[3]
        matched = []
        for i in range(n):
            got = host_page(host, int(dst[i * page]), page)
            # Each vLLM block of the page must be, bit for bit, one block vLLM's own cache holds.
            for j in range(0, page, per_block):
                want = got[:, :, j:j + per_block]
                hits = [b for b in range(blocks.shape[0]) if torch.equal(blocks[b], want)]
                matched.append(hits[0] if hits else -1)
        return {"pages": len(keys), "exists": n, "ok": ok, "matched_blocks": matched,
                "stats": {k: v for k, v in be.kvtier_stats().items() if k != "tiers"}}
    finally:
        be.close()


def write(job: dict[str, Any]) -> dict[str, Any]:
    page, tokens = job["page"], job["tokens"]
    pages: torch.Tensor = torch.load(job["kv"])
    keys = get_storage_hash_str(tokens, None, page_size=page)[:pages.shape[0]]
    be, host = backend(job, len(keys))
    try:
        src = host.alloc(len(keys) * page)
        for i in range(len(keys)):
            host_page(host, int(src[i * page]), page).copy_(pages[i])
        ok = be.batch_set_v1(keys, src)
        return {"pages": len(keys), "ok": ok}
    finally:
        be.close()


def main() -> None:
    verb, path = sys.argv[1], sys.argv[2]
    job = json.loads(open(path).read())
    result = {"read": read, "write": write}[verb](job)
    print(json.dumps(result))


if __name__ == "__main__":
    main()

"""One TP rank of a two-rank HiCacheController, for check_tp.py (run as a script).

    python tp_worker.py RANK INIT_FILE DISK_DIR PAGES_TO_BACK_UP OUT_JSON

Both ranks back up pages of the same prompt into a shared disk tier (each rank its own heads,
so its own namespace), rank 1 fewer of them; then both prefetch the prompt. SGLang MIN-reduces
the per-rank ``batch_exists`` counts over the TP group, so both must report rank 1's count.
"""

from __future__ import annotations

import json
import sys
import threading

import torch
import torch.distributed as dist
from pools import BACKEND, mha_pools
from sglang.srt.managers.cache_controller import HiCacheController
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_parallel

PAGE = 4


def main() -> None:
    rank, init, disk, backed, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    get_parallel().override_permanently(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    dev, host = mha_pools("page_first", ratio=8.0)
    alloc = PagedTokenToKVPoolAllocator(dev.size, PAGE, torch.bfloat16, "cpu", dev, need_sort=False)
    extra = {**BACKEND, "cpu": {"enabled": False}, "disk": {"enabled": True, "path": disk}}
    cc = HiCacheController(alloc, host, PAGE, tp_group=dist.group.WORLD,
                           load_cache_event=threading.Event(), write_policy="write_through",
                           io_backend="direct", storage_backend="dynamic", prefetch_threshold=PAGE,
                           model_name="tiny", storage_backend_extra_config=extra)
    tokens = list(range(70, 70 + 6 * PAGE))
    n = backed * PAGE
    src = host.alloc(n)
    hashes = get_storage_hash_str(tokens[:n], None, page_size=PAGE)
    cc.write_storage(src, tokens[:n], hash_value=hashes)
    done = cc.ack_backup_queue.get(timeout=60).completed_tokens
    # disk is the first tier here: batch_set_v1 wrote it on the backup thread, before the ack
    dist.barrier()
    local = cc.storage_backend.batch_exists(get_storage_hash_str(tokens, None, page_size=PAGE))
    cc.prefetch(f"req-{rank}", tokens)
    op = cc.prefetch_hit_queue.get(timeout=60)
    json.dump({"backed_up_tokens": done, "local_exists_pages": local,
               "tp_min_hit_tokens": op.storage_hit_count}, open(out, "w"))
    dist.barrier()


if __name__ == "__main__":
    main()

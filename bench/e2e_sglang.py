"""SGLang HiCache L3 throughput through the real HiCacheController threads on CPU:
kvtier (cpu, disk, kvtier-server tiers) vs SGLang's own ``file`` backend, same pages, same run.

Runs in the SGLang venv (scripts/test.sh builds it):

    /work/venvs/sglang/bin/python bench/e2e_sglang.py --quick

Per repeat and backend: fresh random K/V pages in a real ``MHATokenToKVPoolHost``; write = the
controller's backup thread storing them (``write_storage`` -> ack); read = a prefetch of the same
tokens (hit query, host buffers, IO thread) until the request completes. Every repeat uses new
tokens, so nothing is skipped as already stored, and the restored bytes are checked. Ratios are
kvtier/file per repeat (min/median/max); the last line is one JSON object with
``read_vs_file_backend`` and ``write_vs_file_backend`` per kvtier tier.
Not measured: device<->host copies (no CPU kernel) and a serving engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "connectors"), str(ROOT / "tests"), str(ROOT / "tests" / "stubs"),
                str(ROOT / "tests" / "sglang_checks"), str(ROOT / "bench")]

from _stats import Stats, fmt, gbps

try:
    import torch
    import torch.distributed as dist
    from pools import BACKEND, mha_pools
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel
except ImportError as exc:
    raise SystemExit(f"e2e_sglang needs the SGLang venv (scripts/test.sh builds /work/venvs/sglang): {exc}") from exc

from kvtier_servers import start_server

TIMEOUT = 300


def make_controller(backend: str, extra: dict[str, Any] | None, args: argparse.Namespace) -> tuple[Any, Any]:
    dev, host = mha_pools(args.layout, page=args.page, heads=args.heads, head_dim=args.head_dim,
                          layers=args.layers, size=args.pages * args.page, ratio=2.5)
    alloc = PagedTokenToKVPoolAllocator(dev.size, args.page, dev.dtype, "cpu", dev, need_sort=False)
    cc = HiCacheController(alloc, host, args.page, tp_group=dist.group.WORLD,
                           load_cache_event=threading.Event(), write_policy="write_through",
                           io_backend="direct", storage_backend=backend, prefetch_threshold=args.page,
                           model_name="bench", storage_backend_extra_config=extra)
    return cc, host


def one_repeat(cc: Any, host: Any, args: argparse.Namespace, rng: random.Random) -> tuple[float, float]:
    n = args.pages * args.page
    tokens = [rng.randrange(1 << 30) for _ in range(n)]
    hashes = get_storage_hash_str(tokens, None, page_size=args.page)
    src = host.alloc(n)
    view = host.kv_buffer.view(-1)
    view[:] = torch.randn(view.numel()).to(view.dtype)
    ref = host.get_data_page(int(src[n - args.page])).clone()
    t0 = time.perf_counter()
    cc.write_storage(src, tokens, hash_value=hashes)
    op = cc.ack_backup_queue.get(timeout=TIMEOUT)
    t_write = time.perf_counter() - t0
    host.free(src)
    if op.completed_tokens != n:
        raise RuntimeError(f"backup stored {op.completed_tokens} of {n} tokens")
    t0 = time.perf_counter()
    cc.prefetch("bench", tokens)
    pf = cc.prefetch_hit_queue.get(timeout=TIMEOUT)
    if pf.storage_hit_count != n:
        raise RuntimeError(f"hit query found {pf.storage_hit_count} of {n} tokens")
    dst = cc.alloc_prefetch_host_buffers(pf, n)
    pf.host_indices = dst
    cc.prefetch_buffer.put(pf)
    done = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=TIMEOUT)
        done = ack.completed_tokens if ack.completed_tokens is not None else done
        if getattr(ack, "completed_req", False):
            break
    t_read = time.perf_counter() - t0
    if done != n or not torch.equal(host.get_data_page(int(dst[n - args.page])), ref):
        raise RuntimeError(f"prefetch restored {done} of {n} tokens or wrong bytes")
    host.free(dst)
    return t_write, t_read


def run_backend(name: str, backend: str, extra: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, list[float]]:
    cc, host = make_controller(backend, extra, args)
    nbytes = args.pages * host.get_data_page(0).numel() * host.kv_buffer.element_size()
    rng = random.Random(args.seed)
    one_repeat(cc, host, args, rng)  # warm-up: imports, first allocations, directory creation
    writes, reads = [], []
    for _ in range(args.repeats):
        tw, tr = one_repeat(cc, host, args, rng)
        writes.append(gbps(nbytes, tw))
        reads.append(gbps(nbytes, tr))
    cc.detach_storage_backend()
    print(f"{name:14s} write {fmt(writes, 'GB/s')}   read {fmt(reads, 'GB/s')}", flush=True)
    return {"write_gbps": writes, "read_gbps": reads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small pages, 3 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pages", type=int, default=64, help="pages per request")
    ap.add_argument("--page", type=int, default=64, help="tokens per page")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--tiers", default="cpu,disk,kvtier-server")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.pages, args.layers, args.heads = 3, 32, 8, 4
    work = Path(tempfile.mkdtemp(prefix="kvtier-e2e-sglang-"))
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(work / "file")
    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    page_mib = 2 * args.layers * args.page * args.heads * args.head_dim * 2 / 2**20
    print(f"{args.pages} pages x {page_mib:.2f} MiB ({args.layout}, bf16), {args.repeats} repeats", flush=True)
    results = {"file": run_backend("sglang-file", "file", None, args)}
    node = None
    try:
        for tier in args.tiers.split(","):
            if tier == "cpu":
                extra = {"cpu": {"capacity_bytes": "4GiB"}}
            elif tier == "disk":
                extra = {"cpu": {"enabled": False}, "disk": {"enabled": True, "path": str(work / "disk")}}
            elif tier == "kvtier-server":
                node = start_server(work / "node", "--cpu-bytes", "4GiB", "--slot-bytes", "8MiB")
                extra = {"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": [node.address]}}
            else:
                raise SystemExit(f"--tiers: unknown tier {tier!r} (cpu, disk, kvtier-server)")
            results[f"kvtier-{tier}"] = run_backend(f"kvtier-{tier}", "dynamic", {**BACKEND, **extra}, args)
    finally:
        if node is not None:
            node.stop()
    out: dict[str, Any] = {"pages": args.pages, "page_tokens": args.page, "page_mib": page_mib,
                           "repeats": args.repeats, "layout": args.layout,
                           "read_vs_file_backend": {}, "write_vs_file_backend": {}}
    base = results["file"]
    for name, res in results.items():
        out[name] = {k: vars(Stats.of(v)) for k, v in res.items()}
        if name == "file":
            continue
        for verb, key in (("read", "read_vs_file_backend"), ("write", "write_vs_file_backend")):
            ratios = [a / b for a, b in zip(res[f"{verb}_gbps"], base[f"{verb}_gbps"])]
            out[key][name] = vars(Stats.of(ratios))
            print(f"{name:14s} {verb} vs file: {fmt(ratios, 'x')}")
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

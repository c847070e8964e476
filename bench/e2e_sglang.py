"""SGLang HiCache L3 throughput through the real HiCacheController threads on CPU:
kvtier (cpu, disk, kvtier-server tiers) vs SGLang's own ``file`` backend, same pages, same run.

Runs in the SGLang venv (scripts/test.sh builds it):

    /work/venvs/sglang/bin/python bench/e2e_sglang.py --quick

Per repeat and backend: fresh random K/V pages in a real ``MHATokenToKVPoolHost``; write = the
controller's backup thread storing them (``write_storage`` -> ack); read = a prefetch of the same
tokens (hit query, host buffers, IO thread) until the request completes. Every repeat uses new
tokens, so nothing is skipped as already stored, and the restored bytes are checked.

Like for like: every backend has its own controller, built before the first repeat, and each
repeat runs every backend back to back (file first), so a ratio kvtier/file pairs two
measurements taken seconds apart on the same machine load (a shared machine's load changes by
minutes; timing one backend after the other would compare loads, not backends). Both use the same
controller path (queues, threads, hit query, TP reduction); only the storage calls differ.
Ratios are per repeat (min/median/max). Two clocks: wall GB/s (what the issue's
``read_vs_file_backend`` / ``write_vs_file_backend`` report) and CPU GB/s (bytes per CPU-second
of the bench process's threads plus, for the kvtier-server tier, the run time of the server
process's threads from ``schedstat``: the ``*_cpu`` keys), which a loaded machine distorts far
less than wall time.

What each kvtier entry is compared with (the media differ; say which you quote):
- ``file``: SGLang's file backend writes with buffered I/O and reads the files it has just
  written, i.e. from the page cache, never from the device.
- ``kvtier-disk``: kvtier's disk tier as configured by default, O_DIRECT: writes reach the device
  and reads come from it. Its ``*_vs_file_backend`` ratios compare device I/O with page-cache
  copies (the headline, kept as it always was); not like for like.
- ``kvtier-disk-buffered``: the disk tier with ``o_direct: false``: page cache on both sides,
  the like-for-like pair for ``file`` (writes and reads).
- ``read_vs_file_backend_cold`` (+ ``_cpu``): ``kvtier-disk`` (O_DIRECT) against ``file-cold``,
  the file backend whose files are written back and dropped from the page cache
  (``fdatasync`` + ``posix_fadvise(DONTNEED)``, outside the clock) before each read: both read
  from the device. The same drop runs before ``kvtier-disk``'s reads (a no-op for O_DIRECT
  files). Writes have no cold variant (``file-cold`` writes exactly as ``file``).
- ``kvtier-kvtier-server``: a kvtier-server on loopback (shared-memory data path) with room for
  every repeat's pages, so every write lands in server memory never touched before: its lazy
  arena takes a page fault per 4 KiB (about 0.9 ms per MiB here, more than the copies).
- ``kvtier-kvtier-server-huge``: the same with ``cpu.huge_pages: true`` (slots rounded up to
  whole 2 MiB multiples): a fault brings in 2 MiB at once, so fresh memory costs far less per
  write; resident memory grows by the rounding (a 4 MiB page + its header takes 6 MiB).
- ``kvtier-kvtier-server-full``: the same server sized to two requests and filled by two
  warm-up requests, so each write evicts older pages and reuses their memory: the steady state
  of a long-running cache. (``file`` never fills its directory here; a full one would unlink
  files and allocate new page-cache pages for each write, so its figures do not improve there.)
Not measured: device<->host copies (no CPU kernel) and a serving engine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "connectors"), str(ROOT / "tests"), str(ROOT / "tests" / "stubs"),
                str(ROOT / "tests" / "sglang_checks"), str(ROOT / "bench")]

from _stats import Stats, fmt, gbps, process_cpu_s

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
TIERS = ("cpu", "disk", "disk-buffered", "kvtier-server", "kvtier-server-huge", "kvtier-server-full")
HUGE = 2 << 20  # cpu.huge_pages wants slots of whole 2 MiB multiples


def make_controller(backend: str, extra: dict[str, Any] | None, args: argparse.Namespace) -> tuple[Any, Any]:
    dev, host = mha_pools(args.layout, page=args.page, heads=args.heads, head_dim=args.head_dim,
                          layers=args.layers, size=args.pages * args.page, ratio=2.5)
    alloc = PagedTokenToKVPoolAllocator(dev.size, args.page, dev.dtype, "cpu", dev, need_sort=False)
    cc = HiCacheController(alloc, host, args.page, tp_group=dist.group.WORLD,
                           load_cache_event=threading.Event(), write_policy="write_through",
                           io_backend="direct", storage_backend=backend, prefetch_threshold=args.page,
                           model_name="bench", storage_backend_extra_config=extra)
    return cc, host


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds of this process (all threads) and of ``pids`` (the run time of their live
    threads, ns from ``schedstat``: a repeat of tens of milliseconds is a few of /proc/PID/stat's
    10 ms ticks)."""
    return time.process_time() + sum(map(process_cpu_s, pids))


class Clock:
    """Wall and CPU seconds of one measured step."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.wall0, self.cpu0 = time.perf_counter(), cpu_seconds(pids)

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall0, cpu_seconds(self.pids) - self.cpu0


def drop_page_cache(root: Path) -> None:
    """Write back, then drop from the page cache, every file under ``root``, so the next read
    of them comes from the device (files renamed or removed meanwhile are skipped)."""
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_repeat(cc: Any, host: Any, args: argparse.Namespace, rng: random.Random, pids: list[int],
               before_read: Callable[[], None] | None = None) -> tuple[tuple[float, float], tuple[float, float]]:
    """((write wall s, write CPU s), (read wall s, read CPU s)) of one request's pages;
    ``before_read`` runs between the two, outside both clocks."""
    n = args.pages * args.page
    tokens = [rng.randrange(1 << 30) for _ in range(n)]
    hashes = get_storage_hash_str(tokens, None, page_size=args.page)
    src = host.alloc(n)
    view = host.kv_buffer.view(-1)
    view[:] = torch.randn(view.numel()).to(view.dtype)
    ref = host.get_data_page(int(src[n - args.page])).clone()
    clock = Clock(pids)
    cc.write_storage(src, tokens, hash_value=hashes)
    op = cc.ack_backup_queue.get(timeout=TIMEOUT)
    t_write = clock.stop()
    host.free(src)
    if op.completed_tokens != n:
        raise RuntimeError(f"backup stored {op.completed_tokens} of {n} tokens")
    if before_read is not None:
        before_read()
    clock = Clock(pids)
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
    t_read = clock.stop()
    if done != n or not torch.equal(host.get_data_page(int(dst[n - args.page])), ref):
        raise RuntimeError(f"prefetch restored {done} of {n} tokens or wrong bytes")
    host.free(dst)
    return t_write, t_read


STORAGE_CALLS = ("batch_exists", "batch_get_v1", "batch_set_v1", "batch_get", "batch_set")


class CallTimer:
    """Wall seconds spent inside the backend's storage calls, by wrapping them on the instance
    the controller holds (SGLang's code is untouched): the rest of an operation's wall time is
    the controller path (queues, threads, hit query, TP reduction, acks, page bookkeeping)."""

    def __init__(self, backend: Any) -> None:
        self.seconds = 0.0
        self._lock = threading.Lock()
        for name in STORAGE_CALLS:
            fn = getattr(backend, name, None)
            if fn is not None:
                setattr(backend, name, self._wrap(fn))

    def _wrap(self, fn: Any) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                with self._lock:
                    self.seconds += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        with self._lock:
            s, self.seconds = self.seconds, 0.0
        return s


class Backend:
    """One backend under its own controller and host pool; per-repeat GB/s lists. ``cold``: a
    directory whose page cache is dropped before every read; ``warmups``: untimed repeats."""

    def __init__(self, name: str, backend: str, extra: dict[str, Any] | None, args: argparse.Namespace,
                 pids: list[int], cold: Path | None = None, warmups: int = 1) -> None:
        self.name, self.args, self.pids = name, args, pids
        self.before_read = None if cold is None else (lambda: drop_page_cache(cold))
        self.cc, self.host = make_controller(backend, extra, args)
        self.nbytes = args.pages * self.host.get_data_page(0).numel() * self.host.kv_buffer.element_size()
        self.rng = random.Random(args.seed)
        self.res: dict[str, list[float]] = {k: [] for k in ("write_gbps", "read_gbps",
                                                              "write_cpu_gbps", "read_cpu_gbps",
                                                              "controller_ms")}
        for _ in range(warmups):  # imports, first allocations (and filling a "-full" server)
            one_repeat(self.cc, self.host, args, self.rng, pids, self.before_read)
        self.calls = CallTimer(self.cc.storage_backend)

    def repeat(self) -> None:
        (w_wall, w_cpu), (r_wall, r_cpu) = one_repeat(self.cc, self.host, self.args, self.rng, self.pids,
                                                      self.before_read)
        # Wall time of the write + read not spent in storage calls (both ops, this repeat).
        self.res["controller_ms"].append(1e3 * max(w_wall + r_wall - self.calls.take(), 0.0))
        for key, secs in (("write_gbps", w_wall), ("read_gbps", r_wall),
                          ("write_cpu_gbps", w_cpu), ("read_cpu_gbps", r_cpu)):
            self.res[key].append(gbps(self.nbytes, max(secs, 1e-9)))

    def report(self) -> None:
        r = self.res
        print(f"{self.name:26s} write {fmt(r['write_gbps'], 'GB/s')}   read {fmt(r['read_gbps'], 'GB/s')}\n"
              f"{'':26s} per CPU-s: write {fmt(r['write_cpu_gbps'], 'GB/s')}   "
              f"read {fmt(r['read_cpu_gbps'], 'GB/s')}\n"
              f"{'':26s} outside storage calls (write + read): {fmt(r['controller_ms'], 'ms')}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small pages, 5 repeats")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--pages", type=int, default=64, help="pages per request")
    ap.add_argument("--page", type=int, default=64, help="tokens per page")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated, of {', '.join(TIERS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the file backend's page copies are torch "
                         "ops, and a thread pool spinning on a small shared host inflates its time; "
                         "kvtier's copies are single-threaded numpy either way)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    if args.quick:
        args.repeats, args.pages, args.layers, args.heads = 5, 32, 8, 4
    tiers = args.tiers.split(",")
    if not set(tiers) <= set(TIERS):
        raise SystemExit(f"--tiers: unknown {sorted(set(tiers) - set(TIERS))} (of {', '.join(TIERS)})")
    work = Path(tempfile.mkdtemp(prefix="kvtier-e2e-sglang-"))
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)  # each file backend has its own
    dist.init_process_group("gloo", init_method=f"file://{work / 'pg'}", rank=0, world_size=1)
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_size=1, attn_dcp_rank=0)
    page_mib = 2 * args.layers * args.page * args.heads * args.head_dim * 2 / 2**20
    print(f"{args.pages} pages x {page_mib:.2f} MiB ({args.layout}, bf16), {args.repeats} repeats", flush=True)
    nodes = []
    # Room for every repeat's pages (each repeat stores new ones) and no more: all backends are
    # alive at once, on a machine other jobs share.
    slot = -(-(int(page_mib * 2**20) + 4096) // 4096) * 4096    # one page chunk (header + page)

    def room_for(slot_bytes: int) -> str:
        return str(slot_bytes * args.pages * (args.repeats + 2) + (64 << 20))

    room = room_for(slot)
    backends = [Backend("file", "file", {"file_storage_path": str(work / "file")}, args, [])]
    if "disk" in tiers:
        backends.append(Backend("file-cold", "file", {"file_storage_path": str(work / "file-cold")}, args, [],
                                cold=work / "file-cold"))
    try:
        for tier in tiers:
            pids: list[int] = []
            cold, warmups = None, 1
            disk = {"enabled": True, "path": str(work / tier)}
            if tier == "cpu":
                extra: dict[str, Any] = {"cpu": {"capacity_bytes": room, "slot_bytes": slot}}
            elif tier == "disk":
                extra, cold = {"cpu": {"enabled": False}, "disk": disk}, work / tier
            elif tier == "disk-buffered":
                extra = {"cpu": {"enabled": False}, "disk": {**disk, "o_direct": False}}
            else:  # kvtier-server, kvtier-server-full (two requests' room, filled by two warm-ups;
                # LRU, so the request being measured evicts the oldest one: the default policy
                # would evict its once-seen pages first, right, but a miss measures nothing)
                full, huge = tier.endswith("-full"), tier.endswith("-huge")
                size = str(slot * args.pages * 2) if full else room
                flags: tuple[str, ...] = ("--set", "cpu.policy=lru") if full else ()
                tier_slot = slot
                if huge:  # each chunk's slot rounded up to whole huge pages: more room
                    tier_slot = -(-slot // HUGE) * HUGE
                    size, flags = room_for(tier_slot), ("--set", "cpu.huge_pages=true")
                node = start_server(work / tier, "--cpu-bytes", size, "--slot-bytes", str(tier_slot), *flags)
                nodes.append(node)
                extra = {"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": [node.address]}}
                pids, warmups = [node.proc.pid], 2 if full else 1
            backends.append(Backend(f"kvtier-{tier}", "dynamic", {**BACKEND, **extra}, args, pids,
                                    cold=cold, warmups=warmups))
        for _ in range(args.repeats):
            for be in backends:          # back to back: the same machine load for every backend
                be.repeat()
        for be in backends:
            be.cc.detach_storage_backend()
            be.report()
    finally:
        for node in nodes:
            node.stop()
    results = {be.name: be.res for be in backends}
    out: dict[str, Any] = {"torch_threads": args.torch_threads, "pages": args.pages, "page_tokens": args.page,
                           "page_mib": page_mib, "repeats": args.repeats, "layout": args.layout}
    for key in ("read_vs_file_backend", "write_vs_file_backend", "read_vs_file_backend_cpu",
                "write_vs_file_backend_cpu", "read_vs_file_backend_cold", "read_vs_file_backend_cold_cpu"):
        out[key] = {}
    pairs = [(name, "file", verb, clock, "") for name in results if not name.startswith("file")
             for verb in ("read", "write") for clock in ("", "_cpu")]
    if "file-cold" in results:  # both from the device: O_DIRECT vs the file backend's cold reads
        pairs += [("kvtier-disk", "file-cold", "read", clock, "_cold") for clock in ("", "_cpu")]
    for name, res in results.items():
        out[name] = {k: vars(Stats.of(v)) for k, v in res.items()}
    for name, base, verb, clock, cold in pairs:
        series = f"{verb}{clock}_gbps"
        ratios = [a / b for a, b in zip(results[name][series], results[base][series])]
        out[f"{verb}_vs_file_backend{cold}{clock}"][name] = vars(Stats.of(ratios))
        print(f"{name:26s} {verb} vs {base}{' (per CPU-s)' if clock else ''}: {fmt(ratios, 'x')}")
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)  # hundreds of MB of pages per run
    print(json.dumps(out))


if __name__ == "__main__":
    main()

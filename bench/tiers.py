"""Local tiers against this machine's own limits, in one run.

    python bench/tiers.py [--quick] [--dir PATH] [--reps N]

Limits, each with the access pattern of the tier op it is compared with: numpy copies of whole
chunks into (and out of) a pre-touched arena, and O_DIRECT sequential writes/reads of
chunk-sized blocks to one file in the disk tier's directory (into already-allocated blocks:
the steady state of a full tier, which reuses its victims' files; the allocating figure is
printed too, next to puts into an empty tier in a fresh directory, repeated like the rest). Tiers, on chunks of a realistic shape: cpu
put / get_into; disk put of encode_chunk's output (page-aligned since chunk.py allocates it
so; full tier, every put evicts), put from staged page-aligned copies, get_into into page-aligned buffers (as pinned staging buffers are) and into
unaligned ones; and the lookup latency of a 131,072-token prompt (its 512 chunk keys plus a
probe of cpu and disk tiers holding all of them: ``lookup_128k_ms`` stops at the cpu tier,
``lookup_128k_disk_ms`` misses in an empty cpu tier and probes the disk index for all 512;
``sha256_128k_ms`` is the key schema's floor, one SHA-256 over the prompt's token bytes timed
in the same loop, and ``lookup_128k_vs_sha256`` the lookup against it).

Method: memory ops are paired op by op (baseline and tier alternate which goes first) on
separate copies of the same bytes, so neither finds the other's data in cache; disk ops run
as whole passes of n ops (the device streams), alternating which pass goes first. Every
figure is repeated (--reps >= 3) and printed as min/median/max; ratios are of medians. The
last line is one JSON object; ``*_ceiling`` are the ratios the one unavoidable extra pass over
the bytes allows (bounce copy of an unaligned O_DIRECT put; checksum of every read).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._stats import fmt, gbps, median, timed
from kvtier.chunk import encode_chunk
from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.keys import chunk_keys
from kvtier.tiers.base import Entry
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.disk import DiskTier, align_up

SHAPE = (24, 2, 256, 2, 64)  # layers, K/V, tokens, kv heads, head_dim; fp16 -> 3 MiB payload
NAMESPACE = bytes(range(32))
PROMPT_TOKENS = 131_072
O_DIRECT = getattr(os, "O_DIRECT", 0)
clock = time.perf_counter


def say(*parts: object) -> None:
    print(*parts, flush=True)


def aligned(nbytes: int) -> memoryview:
    """A page-aligned, pre-touched buffer."""
    view = memoryview(mmap.mmap(-1, nbytes))
    np.frombuffer(view, dtype=np.uint8)[:: mmap.PAGESIZE] = 1
    return view


def make_chunks(n: int, rep: int) -> tuple[list[bytes], list[memoryview]]:
    rng = np.random.default_rng(rep)
    payload_len = int(np.prod(SHAPE)) * 2
    keys = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(n)]
    base = rng.integers(0, 256, payload_len + 64 * n, dtype=np.uint8)
    chunks = [encode_chunk(NAMESPACE, k, "float16", SHAPE, base[64 * i : 64 * i + payload_len].data)
              for i, k in enumerate(keys)]
    return keys, chunks


def _rekey(view: memoryview, key: bytes) -> None:
    """Give the chunk in ``view`` the header it has under ``key`` (payload unchanged)."""
    view[:128] = encode_chunk(NAMESPACE, key, "float16", SHAPE, view[128:])[:128]


@contextlib.contextmanager
def workdir(parent: str | None) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=parent or "/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def lookup_latency(root: Path, reps: int) -> dict[str, float]:
    """keys + probe of a 128k-token prompt, every chunk present in the cpu and disk tiers
    (``lookup_128k_ms``: the cpu tier answers for every key, so the disk index is never
    probed) and, interleaved with it, the same prompt through a store whose cpu tier holds
    none of them (``lookup_128k_disk_ms``: the cpu probe misses at once and the disk index
    answers for all 512 keys). The tiers hold small chunks here: a probe never touches chunk
    bytes, only the index."""
    tokens = np.random.default_rng(7).integers(0, 128_000, PROMPT_TOKENS, dtype=np.uint32)
    keys = chunk_keys(NAMESPACE, tokens, SHAPE[2])
    cpu = CpuTier(CpuTierConfig(capacity_bytes=len(keys) * 4096, slot_bytes=4096))
    cold_cpu = CpuTier(CpuTierConfig(capacity_bytes=len(keys) * 4096, slot_bytes=4096))
    disk = DiskTier(DiskTierConfig(path=str(root / "lookup"), capacity_bytes=len(keys) * 4096 * 2))
    tiny = [Entry(k, encode_chunk(NAMESPACE, k, "float16", (1, 2, 1, 1, 64), bytes(256)), depth=i)
            for i, k in enumerate(keys)]
    assert all(cpu.put(tiny)) and all(disk.put(tiny))
    store = _store([cpu, disk])
    disk_store = _store([cold_cpu, disk])
    # The floor the key schema sets: one SHA-256 pass over the prompt's token bytes (every
    # chunk key hashes its own tokens once), timed in the same loop on this machine.
    token_bytes = tokens.tobytes()
    sha_ms: list[float] = []
    keys_ms, probe_ms, both_ms, total_ms, disk_probe_ms, disk_total_ms = [], [], [], [], [], []
    for i in range(max(reps, 20)):
        t_keys = timed(lambda: chunk_keys(NAMESPACE, tokens, SHAPE[2]))
        sha_ms.append(timed(lambda: hashlib.sha256(token_bytes).digest()) * 1e3)
        t_both = timed(lambda: (cpu.contains(keys), disk.contains(keys)))
        if i % 2:  # alternate which store goes first
            t_disk = timed(lambda: disk_store.lookup(keys)) if disk_store is not None else \
                timed(lambda: (cold_cpu.contains(keys), disk.contains(keys)))
            t_probe = timed(lambda: store.lookup(keys)) if store is not None else t_both
        else:
            t_probe = timed(lambda: store.lookup(keys)) if store is not None else t_both
            t_disk = timed(lambda: disk_store.lookup(keys)) if disk_store is not None else \
                timed(lambda: (cold_cpu.contains(keys), disk.contains(keys)))
        keys_ms.append(t_keys * 1e3)
        probe_ms.append(t_probe * 1e3)
        both_ms.append(t_both * 1e3)
        total_ms.append((t_keys + t_probe) * 1e3)
        disk_probe_ms.append(t_disk * 1e3)
        disk_total_ms.append((t_keys + t_disk) * 1e3)
    assert cpu.contains(keys) == disk.contains(keys) == len(keys) and cold_cpu.contains(keys) == 0
    if store is not None and disk_store is not None:
        assert store.lookup(keys).hits == len(keys)
        found = disk_store.lookup(keys)  # every hit is the disk tier's: its index was probed
        assert found.runs == ((disk.name, len(keys)),), found
        store.close()
        disk_store.close()
    say(f"lookup of a {PROMPT_TOKENS}-token prompt ({len(keys)} chunk keys); probe via "
        f"{'TieredStore.lookup' if store is not None else 'cpu.contains + disk.contains'}")
    say(f"  keys                     {fmt(keys_ms, 'ms', 3)}")
    say(f"  probe (cpu holds all)    {fmt(probe_ms, 'ms', 3)}")
    say(f"  probe (cpu misses, disk) {fmt(disk_probe_ms, 'ms', 3)}")
    say(f"  cpu + disk full probes   {fmt(both_ms, 'ms', 3)}")
    say(f"  lookup = keys + probe    {fmt(total_ms, 'ms', 3)}")
    say(f"  lookup, from disk        {fmt(disk_total_ms, 'ms', 3)}")
    say(f"  sha256 of the tokens     {fmt(sha_ms, 'ms', 3)} (the schema's floor)")
    cpu.close()
    cold_cpu.close()
    disk.close()
    return {"keys_ms": median(keys_ms), "probe_ms": median(probe_ms),
            "probe_cpu_disk_ms": median(both_ms), "lookup_128k_ms": median(total_ms),
            "probe_disk_ms": median(disk_probe_ms), "lookup_128k_disk_ms": median(disk_total_ms),
            "sha256_128k_ms": median(sha_ms), "lookup_128k_vs_sha256": median(total_ms) / median(sha_ms)}


def _store(tiers: list[Any]) -> Any:
    """A TieredStore over these tiers when kvtier/store.py provides one, else None."""
    try:
        from kvtier.store import TieredStore
    except ImportError:
        return None
    store = TieredStore(tiers)
    return store if callable(getattr(store, "lookup", None)) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer chunks and repeats (< 60 s)")
    ap.add_argument("--dir", help="parent directory for the disk tier (default: under /tmp)")
    ap.add_argument("--reps", type=int, default=0, help="repeats per figure (default 9, quick 5)")
    args = ap.parse_args()
    reps = max(3, args.reps or (5 if args.quick else 9))
    n = 48 if args.quick else 64  # chunks per pass: 144 / 192 MiB, well past the 32 MiB L3

    keys0, chunks0 = make_chunks(n, 0)
    size = len(chunks0[0])
    padded = slot = align_up(size)
    say(f"chunk: {SHAPE[0]} layers x {SHAPE[1]} (K,V) x {SHAPE[2]} tokens x {SHAPE[3]} kv heads x "
        f"{SHAPE[4]} head_dim, float16 = {size - 128} payload + 128 header = {size / 2**20:.3f} MiB; "
        f"{n} chunks per pass, {reps} passes")
    say("memory: each tier op is timed next to its baseline op (order alternating) on separate "
        "copies of the same bytes, so both start from memory, not cache; disk: whole passes of "
        "n ops, tier and baseline alternating which goes first")
    # Baseline buffers (a) and tier buffers (b) never share memory.
    outs_a = [aligned(padded) for _ in range(n)]  # page-aligned, as pinned staging buffers are
    outs_b = [aligned(padded) for _ in range(n)]
    unaligned = [memoryview(bytearray(padded + 1))[1:] for _ in range(n)]
    staged = [aligned(padded) for _ in range(n)]  # page-aligned put sources
    arena = np.frombuffer(aligned(n * slot), dtype=np.uint8)
    fig: dict[str, list[float]] = {}

    def pair(t: dict[str, float], i: int, first: tuple[str, Callable[..., Any], tuple[Any, ...]],
             second: tuple[str, Callable[..., Any], tuple[Any, ...]]) -> list[Any]:
        """Time two ops, the baseline first on even chunks and the tier first on odd ones."""
        results = []
        for name, fn, fn_args in (first, second) if i % 2 == 0 else (second, first):
            start = clock()
            results.append(fn(*fn_args))
            t[name] += clock() - start
        return results

    def passes(t: dict[str, float], rep: int, first: tuple[str, Callable[..., Any], list[tuple[Any, ...]]],
               second: tuple[str, Callable[..., Any], list[tuple[Any, ...]]]) -> list[Any]:
        """Time two whole passes (n ops each, back to back: the device streams), baseline
        first on even passes, tier first on odd ones; returns the tier pass's results."""
        results: dict[str, list[Any]] = {}
        for name, fn, calls in (first, second) if rep % 2 == 0 else (second, first):
            start = clock()
            results[name] = [fn(*fn_args) for fn_args in calls]
            t[name] += clock() - start
        return results[second[0]]

    def record(t: dict[str, float]) -> None:
        for name, seconds in t.items():
            fig.setdefault(name, []).append(gbps(n * size, seconds))

    with workdir(args.dir) as root:
        # LRU: each pass's new chunks must displace the previous pass's (a frequency-aware
        # policy would rightly keep the re-read old ones); this bench measures the data path.
        cpu = CpuTier(CpuTierConfig(capacity_bytes=n * slot, slot_bytes=slot, policy="lru"))
        disk = DiskTier(DiskTierConfig(path=str(root / "disk"), capacity_bytes=n * padded, policy="lru"))
        say(f"disk tier at {disk.root}: {'O_DIRECT' if disk.direct else 'buffered I/O (O_DIRECT refused)'}")
        base = str(root / "direct.dat")
        # Cold writes: an empty tier in a fresh directory next to allocating writes of a new
        # file there, repeated, the order alternating; the directory goes after each sample.
        for rep in range(reps):
            cold = root / f"cold{rep}"
            cold_disk = DiskTier(DiskTierConfig(path=str(cold / "disk"), capacity_bytes=n * padded,
                                                policy="lru"))
            t: dict[str, float] = collections.defaultdict(float)
            fd = os.open(cold / "direct.dat", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
            put_ok = passes(t, rep, ("dw_alloc", os.pwrite, [(fd, outs_a[i][:padded], i * padded) for i in range(n)]),
                            ("disk_put_cold", cold_disk.put, [([Entry(k, c)],) for k, c in zip(keys0, chunks0)]))
            os.close(fd)
            assert all(ok for res in put_ok for ok in res), "a cold put failed"
            cold_disk.close()
            shutil.rmtree(cold)
            record(t)
        # Fill the tiers the steady-state passes evict from (untimed).
        fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | O_DIRECT, 0o644)
        for i in range(n):
            os.pwrite(fd, outs_a[i][:padded], i * padded)
        os.close(fd)
        assert all(disk.put([Entry(k, c) for k, c in zip(keys0, chunks0)]))
        cpu.put([Entry(k, c) for k, c in zip(keys0, chunks0)])
        wfd, rfd = os.open(base, os.O_WRONLY | O_DIRECT), os.open(base, os.O_RDONLY | O_DIRECT)
        for rep in range(1, reps + 1):
            keys, chunks = make_chunks(n, rep)  # new keys: every put into the full tiers evicts
            copies = [bytearray(c) for c in chunks]  # the baseline's own source memory
            t = collections.defaultdict(float)
            ok: list[Any] = []
            # Memory: op by op, each tier op next to its baseline op.
            for i, (k, c) in enumerate(zip(keys, chunks)):
                src = np.frombuffer(copies[i], dtype=np.uint8)
                ok += pair(t, i, ("copy_in", np.copyto, (arena[i * slot : i * slot + size], src)),
                           ("cpu_put", cpu.put, ([Entry(k, c)],)))[1 - i % 2]
            got: list[Any] = []
            for i, k in enumerate(keys):
                dst = np.frombuffer(outs_a[i], dtype=np.uint8)[:size]
                got += pair(t, i, ("copy_out", np.copyto, (dst, arena[i * slot : i * slot + size])),
                            ("cpu_get", cpu.get_into, ([k], [outs_b[i]])))[1 - i % 2]
            # Disk: pass by pass, so that the device streams as it does for the baseline.
            writes = [(wfd, outs_a[i][:padded], i * padded) for i in range(n)]
            reads = [(rfd, [outs_a[i][:padded]], i * padded) for i in range(n)]
            for res in passes(t, rep, ("dw", os.pwrite, writes),
                              ("disk_put", disk.put, [([Entry(k, c)],) for k, c in zip(keys, chunks)])):
                ok += res
            assert all(ok), "a put failed"
            for res in passes(t, rep, ("dr", os.preadv, reads),
                              ("disk_get", disk.get_into, [([k], [outs_b[i]]) for i, k in enumerate(keys)])):
                got += res
            # What verifying costs: one xxh3 pass over each just-read chunk (memory speed).
            start = clock()
            for out in outs_a:
                xxhash.xxh3_64_intdigest(out[128:size])
            t["xxh3"] += clock() - start
            for res in passes(t, rep + 1, ("dr_u", os.preadv, reads), ("disk_get_unaligned", disk.get_into,
                                                                       [([k], [unaligned[i]]) for i, k in enumerate(keys)])):
                got += res
            assert got == [size] * (3 * n), "a tier lost chunks it should hold"
            assert bytes(outs_b[-1][:size]) == bytes(unaligned[-1][:size]) == chunks[-1]
            # The same bytes from page-aligned sources (no bounce copy), under fresh keys.
            fresh = [hashlib.sha256(b"aligned/%d/%d" % (rep, i)).digest() for i in range(n)]
            for view, c, k in zip(staged, chunks, fresh):
                view[:size] = c
                _rekey(view[:size], k)
            passes(t, rep + 1, ("dw2", os.pwrite, writes),
                   ("disk_put_aligned_src", disk.put, [([Entry(k, staged[i][:size])],) for i, k in enumerate(fresh)]))
            assert disk.get([fresh[-1]]) == [bytes(staged[-1][:size])]
            record(t)
        os.close(wfd)
        os.close(rfd)
        assert disk.check() == [] and cpu.check() == []
        cpu.close()
        disk.close()
        for label, name in (
            ("numpy copy into arena", "copy_in"), ("cpu put", "cpu_put"),
            ("numpy copy out of arena", "copy_out"), ("cpu get_into", "cpu_get"),
            ("O_DIRECT write, allocated file", "dw"), ("disk put, full tier (evicts)", "disk_put"),
            ("O_DIRECT write, new file", "dw_alloc"), ("disk put, empty tier", "disk_put_cold"),
            ("O_DIRECT write (again)", "dw2"), ("disk put, aligned source", "disk_put_aligned_src"),
            ("O_DIRECT read", "dr"), ("disk get_into, aligned out", "disk_get"),
            ("O_DIRECT read (again)", "dr_u"), ("disk get_into, unaligned out", "disk_get_unaligned"),
            ("xxh3 checksum of read chunks", "xxh3"),
        ):
            say(f"{label:32s} {fmt(fig[name], 'GB/s')}")
        look = lookup_latency(root, reps)

    med = {k: median(v) for k, v in fig.items()}
    result = {
        "chunk_bytes": size, "chunks_per_pass": n, "reps": reps,
        "copy_gbps": med["copy_in"], "copy_out_gbps": med["copy_out"],
        "cpu_put_gbps": med["cpu_put"], "cpu_get_gbps": med["cpu_get"],
        "disk_direct_write_gbps": med["dw"], "disk_direct_write_alloc_gbps": med["dw_alloc"],
        "disk_direct_read_gbps": med["dr"],
        "disk_put_gbps": med["disk_put"], "disk_put_cold_gbps": med["disk_put_cold"],
        "disk_put_aligned_src_gbps": med["disk_put_aligned_src"],
        "disk_get_gbps": med["disk_get"], "disk_get_unaligned_gbps": med["disk_get_unaligned"],
        "cpu_put_ratio": med["cpu_put"] / med["copy_in"],
        "cpu_get_ratio": med["cpu_get"] / med["copy_out"],
        "disk_write_ratio": med["disk_put"] / med["dw"],
        "disk_read_ratio": med["disk_get"] / med["dr"],
        "disk_write_cold_ratio": med["disk_put_cold"] / med["dw_alloc"],
        "disk_write_aligned_src_ratio": med["disk_put_aligned_src"] / med["dw2"],
        "disk_read_unaligned_ratio": med["disk_get_unaligned"] / med["dr_u"],
        "checksum_gbps": med["xxh3"],
        # Ceilings set by the one extra pass over the bytes each path must make:
        # the O_DIRECT bounce copy of an unaligned put, the checksum of every read.
        "disk_write_ceiling": 1 / (1 + med["dw"] / med["copy_in"]),
        "disk_read_ceiling": 1 / (1 + med["dr"] / med["xxh3"]),
        **look,
    }
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}), flush=True)


if __name__ == "__main__":
    main()

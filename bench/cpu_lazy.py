"""Put throughput of the server's lazily backed RAM arena against the pre-touched one, in one run.

    python bench/cpu_lazy.py [--quick] [--reps N]

A full tier of 1 MiB slots takes a stream of 1 MiB puts in three ways: the library's
pre-touched arena evicting for itself; a lazy arena (``CpuTier(..., lazy=True)``, what
kvtier-server builds) where the pool sheds the putting tenant's own chunks first
(``shed(reuse=True)``: the slot keeps its pages); and a lazy arena where the pages go back to
the OS before the put (``shed()``: what another tenant's put costs, a fault and zeroing per
page). The last case again with 4 MiB slots (the server's default), the arena on small pages
and on transparent huge pages (``cpu.huge_pages``): ``fresh_huge_vs_small_4mib``. Figures are GiB/s over --reps runs, min/median/max;
the last line is one JSON object.

First pass (``first_pass_*``): a lazy arena with room for every put (a server that has not
used its RAM yet) takes 4 MiB puts into never-touched slots, with and without kvtier-server's
warm-ahead thread (``cpu.warm_ahead_bytes``, default 256 MiB, faulting in free slots ahead of
the puts), back to back (the thread races the puts for a second core) and paced (a 2 ms pause
after each put, time inside the puts only: an engine writing back between forward passes).
``first_pass_warm_vs_cold_4mib`` and ``first_pass_paced_warm_vs_cold_4mib`` are the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvtier.config import CpuTierConfig
from kvtier.server.pool import SharedPool
from kvtier.server.warm_ahead import WarmAhead
from kvtier.tiers.base import Entry
from kvtier.tiers.cpu import CpuTier

SLOT = 1 << 20


def one_run(slots: int, lazy: bool, shed: bool, reuse: bool, slot: int = SLOT, huge: bool = False) -> float:
    data = bytes(range(256)) * (slot // 256)
    keys = [i.to_bytes(32, "little") for i in range(2 * slots)]
    tier = CpuTier(CpuTierConfig(capacity_bytes=slots * slot, slot_bytes=slot, pin_memory="never",
                                 huge_pages=huge), lazy=lazy)
    try:
        assert all(tier.put([Entry(k, data) for k in keys[:slots]]))  # full
        start = time.perf_counter()
        for key in keys[slots:]:
            if shed:
                tier.shed(slot, reuse=reuse)
            tier.put([Entry(key, data)])
        return slots * slot / (time.perf_counter() - start) / 2**30
    finally:
        tier.close()


def first_pass(puts: int, warm_ahead: bool, pause_s: float, slot: int = 4 * SLOT) -> float:
    """GiB/s of ``puts`` puts into an empty lazy arena with room for all of them (time inside
    the puts), the server's warm-ahead thread on or off."""
    data = bytes(range(256)) * (slot // 256)
    tier = CpuTier(CpuTierConfig(capacity_bytes=puts * slot, slot_bytes=slot, pin_memory="never"), lazy=True)
    pool = SharedPool(puts * slot, {"t": tier}, {"t": puts * slot})
    warm = WarmAhead([tier], pool, CpuTierConfig().warm_ahead_bytes) if warm_ahead else None
    try:
        time.sleep(0.3)  # a server is up before its first put: let the reserve fill
        busy = 0.0
        for i in range(puts):
            start = time.perf_counter()
            tier.put([Entry(i.to_bytes(32, "little"), data)])
            busy += time.perf_counter() - start
            if pause_s:
                time.sleep(pause_s)
        return puts * slot / busy / 2**30
    finally:
        if warm is not None:
            warm.close()
        tier.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 slots instead of 256")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    slots = 32 if args.quick else 256
    big = 4 * SLOT
    modes = {"pretouched_self_evict": (False, False, False, SLOT, False),
             "lazy_shed_reuse": (True, True, True, SLOT, False), "lazy_shed_fresh_pages": (True, True, False, SLOT, False),
             "lazy_fresh_4mib_small_pages": (True, True, False, big, False),
             "lazy_fresh_4mib_huge_pages": (True, True, False, big, True)}
    out: dict[str, float] = {}
    for name, (lazy, shed, reuse, slot, huge) in modes.items():
        runs = [one_run(slots * SLOT // slot, lazy, shed, reuse, slot, huge) for _ in range(args.reps)]
        med = statistics.median(runs)
        print(f"{name}: put GiB/s min {min(runs):.2f} median {med:.2f} max {max(runs):.2f}")
        out[f"{name}_gibps"] = round(med, 3)
    out["lazy_reuse_vs_pretouched"] = round(out["lazy_shed_reuse_gibps"] / out["pretouched_self_evict_gibps"], 3)
    out["lazy_fresh_vs_pretouched"] = round(out["lazy_shed_fresh_pages_gibps"] / out["pretouched_self_evict_gibps"], 3)
    out["fresh_huge_vs_small_4mib"] = round(out["lazy_fresh_4mib_huge_pages_gibps"]
                                            / out["lazy_fresh_4mib_small_pages_gibps"], 3)
    puts = 32 if args.quick else 256  # 128 MiB / 1 GiB: the second passes the default reserve
    for paced, pause in (("", 0.0), ("paced_", 0.002)):
        for warm in (False, True):
            name = f"first_pass_{paced}{'warm_ahead' if warm else 'cold'}_4mib"
            runs = [first_pass(puts, warm, pause) for _ in range(args.reps)]
            med = statistics.median(runs)
            print(f"{name}: put GiB/s min {min(runs):.2f} median {med:.2f} max {max(runs):.2f}")
            out[f"{name}_gibps"] = round(med, 3)
        out[f"first_pass_{paced}warm_vs_cold_4mib"] = round(out[f"first_pass_{paced}warm_ahead_4mib_gibps"]
                                                            / out[f"first_pass_{paced}cold_4mib_gibps"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

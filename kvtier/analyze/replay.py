"""Replay a log through kvtier's real eviction policies: the reuse bound, curves and TTLs.

The replay is the store's lookup-then-store loop on one tier of fixed slots (one chunk per
slot, as the cpu arena holds them): per request, the hits are the *leading* run of chunk keys
present (a present chunk after the first miss does not count, as in ``Tier.contains``); the hit
chunks are accessed, then every chunk from the first miss on is inserted with ``depth`` = its
index and ``parent`` = the chunk before, evicting as needed. Policies come from the registry
(:data:`kvtier.policies.POLICIES`), so whatever kvtier ships is what is replayed; ``belady``
(:class:`~kvtier.analyze.belady.BeladyPolicy`) is Belady's MIN on the same loop (optimal per
chunk, a reference rather than a bound under the leading-run rule).

All functions are pure and deterministic; each returns per-request hit tokens (int64 numpy
arrays, in the order of the requests given: the log's replay order) so that reports can group
them by tenant or model.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from kvtier.analyze.belady import BeladyPolicy
from kvtier.analyze.records import Request
from kvtier.policies import DEFAULT_POLICY, POLICIES, EvictionPolicy

BELADY = "belady"


def _hit_tokens(r: Request, k: int) -> int:
    return r.tokens if k == len(r.keys) else k * r.chunk_tokens


def access_sequence(requests: Sequence[Request]) -> list[bytes]:
    """Every key in the order the replay loop touches them (each request's keys, in order)."""
    return [key for r in requests for key in r.keys]


def replay_leading_hits(key_lists: Iterable[Sequence[bytes]], policy: EvictionPolicy,
                        capacity: int) -> tuple[list[int], int]:
    """The loop itself, on bare key lists: (leading hit chunks of each request, evictions).
    Raises AssertionError when the policy does not track exactly the keys the cache holds."""
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1 chunk, got {capacity}")
    contains = policy.__contains__
    access, insert, evict = policy.access, policy.insert, policy.evict
    hits: list[int] = []
    used = evictions = 0
    for ids in key_lists:
        n = len(ids)
        k = 0
        while k < n and contains(ids[k]):
            k += 1
        hits.append(k)
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
    return hits, evictions


def replay(requests: Sequence[Request], policy: EvictionPolicy, capacity: int) -> np.ndarray:
    """Per-request leading-hit tokens through a ``capacity``-chunk cache run by ``policy``."""
    hits, _ = replay_leading_hits((r.keys for r in requests), policy, capacity)
    return np.fromiter((_hit_tokens(r, k) for r, k in zip(requests, hits)), dtype=np.int64, count=len(requests))


def unbounded(requests: Sequence[Request]) -> np.ndarray:
    """The bound: per-request hit tokens of a perfect (infinite, never-expiring) prefix cache."""
    seen: set[bytes] = set()
    out = np.zeros(len(requests), dtype=np.int64)
    for j, r in enumerate(requests):
        ids = r.keys
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        out[j] = _hit_tokens(r, k)
        seen.update(ids)
    return out


def hit_chunks(r: Request, hit_tokens: int) -> int:
    """How many leading chunks of ``r`` make ``hit_tokens`` (the inverse of the replay's count)."""
    return len(r.keys) if hit_tokens == r.tokens else hit_tokens // r.chunk_tokens


def with_ttl(requests: Sequence[Request], ttl_s: float) -> np.ndarray:
    """Per-request hit tokens of an unbounded cache whose chunks expire ``ttl_s`` seconds after
    their last read or write (a sliding TTL, as hosted prompt caches refresh on a hit).

    ``requests`` are taken in the order given (the reader's is timestamp order). The clock never
    moves backwards: a request without a timestamp, or with one earlier than a request before
    it, is taken at the latest time so far; so no chunk's age is negative (which would count as
    a hit) and no chunk's last use moves back in time."""
    last: dict[bytes, float] = {}
    out = np.zeros(len(requests), dtype=np.int64)
    now = next((r.timestamp for r in requests if r.timestamp is not None), 0.0)
    for j, r in enumerate(requests):
        if r.timestamp is not None and r.timestamp > now:
            now = r.timestamp
        ids = r.keys
        k = 0
        while k < len(ids):
            t = last.get(ids[k])
            if t is None or now - t > ttl_s:
                break
            k += 1
        out[j] = _hit_tokens(r, k)
        for key in ids:
            last[key] = now
    return out


@dataclass(frozen=True)
class CurvePoint:
    policy: str
    capacity_chunks: int
    hits: np.ndarray  # per-request hit tokens

    @property
    def hit_tokens(self) -> int:
        return int(self.hits.sum())


def policy_names() -> list[str]:
    """The registered policies, the default first, then ``belady``."""
    return list(dict.fromkeys([DEFAULT_POLICY, *POLICIES, BELADY]))


# What forked workers replay: set by ``curve`` just before it forks, read by ``_job`` in the
# children (fork shares it copy-on-write: the requests are not pickled per job).
_SHARED: tuple[Sequence[Request], list[bytes]] = ((), [])


def _job(job: tuple[int, str]) -> CurvePoint:
    cap, name = job
    requests, seq = _SHARED
    policy: EvictionPolicy = BeladyPolicy(seq) if name == BELADY else POLICIES[name]()
    return CurvePoint(name, cap, replay(requests, policy, cap))


def curve(requests: Sequence[Request], capacities: Sequence[int], names: Sequence[str],
          progress: bool = False, jobs: int = 1) -> list[CurvePoint]:
    """Replay every (capacity, policy) pair; ``names`` are registry names or ``belady``.

    ``jobs`` > 1 runs the replays in that many forked processes (each replay is independent
    and deterministic, so the result is the same); where fork is unavailable they run here.
    """
    global _SHARED
    unknown = [n for n in names if n != BELADY and n not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; expected one of {sorted(POLICIES)} or {BELADY!r}")
    work = [(c, n) for c in capacities for n in names]
    _SHARED = (requests, access_sequence(requests) if BELADY in names else [])
    try:
        bar = tqdm(total=len(work), desc="replay", unit="run", disable=not progress, leave=False)
        with bar:
            if jobs > 1 and len(work) > 1 and "fork" in mp.get_all_start_methods():
                with mp.get_context("fork").Pool(min(jobs, len(work))) as pool:
                    out = []
                    for point in pool.imap(_job, work):
                        out.append(point)
                        bar.update()
                    return out
            out = []
            for job in work:
                out.append(_job(job))
                bar.update()
            return out
    finally:
        _SHARED = ((), [])


def default_capacities(distinct_chunks: int, percents: Sequence[float] = (2, 5, 10, 20, 40, 80)) -> list[int]:
    """Capacities (chunks) at ``percents`` of the log's distinct chunks, deduplicated."""
    return sorted({max(1, int(distinct_chunks * p / 100)) for p in percents})

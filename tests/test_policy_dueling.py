"""The default policy, ``dueling`` (kvtier.policies.dueling): it follows s3fifo where its
miniature simulations show s3fifo winning (passes over a corpus a little larger than the
cache, which adaptive thrashes on), lfu where counts win (chat served round-robin, questions
over a corpus) and stays with adaptive where adaptive wins (the shared trace); every candidate
always tracks the same keys; ``forget_evicted`` leaves the history an eviction leaves. The contract itself (pins, determinism, any op sequence) is checked for every
registered policy in tests/test_policy.py."""

from __future__ import annotations

import importlib.util
import sys
import zlib
from pathlib import Path

import pytest

from kvtier.analyze.replay import replay_leading_hits
from kvtier.policies import (
    AdaptivePolicy,
    DuelingPolicy,
    EvictionPolicy,
    LFUPolicy,
    LRUPolicy,
    S3FIFOPolicy,
    make_policy,
)
from tests.policy_ops import k

REPO = Path(__file__).resolve().parents[1]
_REL = Path("shared/traces/synthetic_trace.jsonl")
TRACE = next((d / _REL for d in REPO.parents if (d / _REL).is_file()), REPO.parent / _REL)


def _generated(name: str, seed: int, scale: float = 0.5) -> list[list[bytes]]:
    sys.path.insert(0, str(REPO / "bench"))
    import workloads

    return [[i.to_bytes(8, "little") for i in ids] for ids in workloads.generate(name, seed, scale)]


def _hit_ratio(requests: list[list[bytes]], policy: EvictionPolicy, pct: int) -> float:
    cap = max(1, len({key for ids in requests for key in ids}) * pct // 100)
    hits, _ = replay_leading_hits(requests, policy, cap)
    return sum(hits) / sum(map(len, requests))


def test_it_leaves_adaptive_over_passes_on_a_corpus_larger_than_the_cache() -> None:
    """``rounds``: every prompt comes back once per pass. At 80% of the corpus adaptive's
    ghosts make every returning block "re-used" and it thrashes like LRU; s3fifo keeps most
    of its main queue, lfu the prompts it counted most. Seeds 5 and 6: not among those the parameters were chosen on (0, 1)."""
    for seed in (5, 6):
        requests = _generated("rounds", seed)
        dueling = DuelingPolicy()
        mine = _hit_ratio(requests, dueling, 80)
        adaptive = _hit_ratio(requests, AdaptivePolicy(), 80)
        s3fifo = _hit_ratio(requests, S3FIFOPolicy(), 80)
        assert s3fifo > adaptive + 0.15  # the workload is what it claims to be
        assert mine > adaptive + 0.05, (seed, mine, adaptive, s3fifo)
        # s3fifo or lfu: both keep a fixed part of the pass (0.57 and 0.55 alone, seed 5).
        assert dueling.leader_name in ("s3fifo", "lfu") and dueling.leader_changes >= 1
        assert all(set(main._nodes) == set(dueling._keys) for main in dueling._mains)
        assert all(len(mini) <= max(1, len(dueling) // dueling._div) for mini in dueling._minis)


def test_it_follows_lfu_on_chat_served_round_robin() -> None:
    """``rrchat``: 150 live conversations, each sending its next turn once per round. The
    cache holds a fraction of a round, so recency thrashes (adaptive, s3fifo, LRU all near
    0.15 at 20%), while counts keep the early turns of the long conversations (lfu ~0.34).
    The two-candidate duel could only pick between the two that lose. Seeds 7 and 8: not
    among those the policy was tuned on (0-2) or judged on (3-5)."""
    for seed in (7, 8):
        requests = _generated("rrchat", seed, 0.15)
        dueling = DuelingPolicy()
        mine = _hit_ratio(requests, dueling, 20)
        lfu, lru = _hit_ratio(requests, LFUPolicy(), 20), _hit_ratio(requests, LRUPolicy(), 20)
        recency = max(_hit_ratio(requests, AdaptivePolicy(), 20), _hit_ratio(requests, S3FIFOPolicy(), 20))
        assert lfu > max(lru, recency) + 0.1  # the workload is what it claims to be
        assert mine > max(lru, recency) + 0.1 and mine > lfu - 0.03, (seed, mine, lfu, lru, recency)
        assert dueling.leader_name == "lfu"


def test_it_leaves_adaptive_on_questions_over_a_corpus() -> None:
    """``docqa``: one document per request, a stable Zipf popularity. Adaptive is the worst
    of the three candidates there; the old rule (the hit counts tested as independent Poisson
    counts) never left it, the paired test does. Seeds 7 and 8, 5 and 10% (held out)."""
    mine, adaptive, best = [], [], []
    for seed in (7, 8):
        requests = _generated("docqa", seed, 0.25)
        for pct in (5, 10):
            dueling = DuelingPolicy()
            mine.append(_hit_ratio(requests, dueling, pct))
            adaptive.append(_hit_ratio(requests, AdaptivePolicy(), pct))
            best.append(max(_hit_ratio(requests, LFUPolicy(), pct), _hit_ratio(requests, S3FIFOPolicy(), pct)))
            assert dueling.leader_name != "adaptive" and dueling.leader_changes >= 1, (seed, pct)
    assert sum(best) > sum(adaptive) + 4 * 0.01  # the workload is what it claims to be
    assert sum(mine) > sum(adaptive) + 4 * 0.01, (mine, adaptive, best)


def test_a_steady_edge_moves_the_leader_and_an_even_split_does_not() -> None:
    """The paired test on hand-fed miniature outcomes (miniature size 4096; lfu's misses
    all): per 13 references both adaptive's (the leader) and s3fifo's miniatures hit on 10,
    s3fifo's alone on 2 and adaptive's alone on 1. After 5200 references s3fifo leads; an even
    split (10 / 3 / 3) never moves it. (The old rule tested the hit counts as independent
    Poisson counts: the 2:1 edge is 9% of the hits against its threshold of 3% plus
    3 * sqrt(8000) ~ 270 hits, and it never moved.)"""
    both, adaptive_only, s3fifo_only = [True, True, False], [True, False, False], [False, True, False]
    for alone, theirs, want in ((1, 2, "s3fifo"), (3, 3, "adaptive")):
        p = DuelingPolicy()
        p.dwell = 0.0
        block = [both] * 10 + [s3fifo_only] * theirs + [adaptive_only] * alone
        for _ in range(5200 // 13):
            for hit in block:
                p._judge(hit, 4096)
        assert p.leader_name == want, (alone, theirs)


@pytest.mark.skipif(not TRACE.is_file(), reason=f"trace not found: {TRACE} (../shared/traces/README.md)")
def test_it_stays_within_a_point_of_adaptive_on_the_held_out_trace() -> None:
    spec = importlib.util.spec_from_file_location("kvtier_bench_replay_d", REPO / "bench" / "replay.py")
    assert spec is not None and spec.loader is not None
    replay = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = replay
    spec.loader.exec_module(replay)
    requests = replay.load_trace(TRACE)
    held_out = requests[len(requests) // 2:]
    for pct in (5, 10, 20, 40):
        mine, adaptive = _hit_ratio(held_out, DuelingPolicy(), pct), _hit_ratio(held_out, AdaptivePolicy(), pct)
        assert mine >= adaptive - 0.01, (pct, mine, adaptive)


def test_nothing_is_sampled_before_the_first_eviction_and_then_a_fixed_fraction() -> None:
    p = DuelingPolicy(floor=4)
    for i in range(200):
        p.insert(k(f"x{i}"), 1, i, k(f"x{i - 1}") if i else b"")
    assert p._div == 0 and all(len(mini) == 0 for mini in p._minis)
    p.evict()
    assert p._div == 16  # 199 keys: the largest power of two up to 16 leaving >= 4 per miniature
    assert p.leader_name == "adaptive" and len(p) == 199
    # Keys tracked before the first eviction join the sample then (they were invisible to the
    # miniatures once, so a prefix written before the cache filled never counted a hit).
    sampled = [key for key, e in p._keys.items() if e[4]]
    assert 0 < len(sampled) < 199 and all(zlib.crc32(key) % 16 == 0 for key in sampled)
    for key, (parent, anc, _, _, _) in p._keys.items():
        want = parent
        while want and want in p._keys and not p._keys[want][4]:
            want = p._keys[want][0]
        assert anc == (want if want in p._keys else b""), key
    p.access(sampled[-1])
    assert all(sampled[-1] in mini for mini in p._minis)


def test_s3fifo_forget_evicted_leaves_the_ghost_its_own_eviction_would() -> None:
    """A key evicted from the small queue unread comes back into the main queue; a removed
    one comes back as new."""
    for forget, queue in ((True, "main"), (False, "small")):
        p = S3FIFOPolicy()
        for name in "abc":
            p.insert(k(name), 1)
        if forget:
            p.forget_evicted(k("a"))
        else:
            p.remove(k("a"))
        p.forget_evicted(k("zz"))  # unknown: ignored
        assert k("a") not in p and len(p) == 2
        p.insert(k("a"), 1)
        assert (k("a") in p._main) == (queue == "main")


def test_adaptive_forget_evicted_teaches_what_an_eviction_does() -> None:
    """A key another policy evicted, inserted again soon, is a regret (the set it left grows);
    a removed key's return teaches nothing."""
    grown = {}
    for how in ("forget", "remove"):
        p = AdaptivePolicy()
        for i in range(8):
            p.insert(k(f"r{i}"), 1)  # fresh keys, nothing re-used
        victim = k("r0")
        if how == "forget":
            p.forget_evicted(victim)
        else:
            p.remove(victim)
        assert victim not in p and len(p) == 7
        before = p._q
        p.insert(victim, 1)
        grown[how] = p._q > before
    assert grown == {"forget": True, "remove": False}


def test_it_is_the_default() -> None:
    assert isinstance(make_policy(), DuelingPolicy)

"""Eviction policies: scripted victim orders, pins, removal, re-insert, and a property test.

Every scripted order below is worked out by hand from the policy's documented rules (the
comment next to each says why), so a change of behaviour shows up as a changed victim list.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies import (
    DEFAULT_POLICY,
    POLICIES,
    LRUPolicy,
    NothingToEvict,
    make_policy,
)
from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.dueling import DuelingPolicy
from kvtier.policies.prefix import PrefixPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy
from tests.policy_ops import drain, insert_all, k

ALL = sorted(POLICIES)
REPO = Path(__file__).resolve().parents[1]
_REL = Path("shared/traces/synthetic_trace.jsonl")
# Beside the checkout or one of its parents (a git worktree sits deeper than the checkout).
TRACE = next((d / _REL for d in REPO.parents if (d / _REL).is_file()), REPO.parent / _REL)


# --- registry --------------------------------------------------------------------------------
def test_registry() -> None:
    assert DEFAULT_POLICY == "dueling"
    assert isinstance(make_policy(), DuelingPolicy)
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)
    assert isinstance(make_policy("prefix"), PrefixPolicy)
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("s3fifo"), S3FIFOPolicy)
    for name in ALL:
        assert make_policy(name).name == name
    with pytest.raises(ValueError, match="unknown eviction policy 'nope'"):
        make_policy("nope")


# --- behaviour every policy shares ----------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_empty_raises(name: str) -> None:
    p = make_policy(name)
    with pytest.raises(NothingToEvict):
        p.evict()
    assert len(p) == 0


@pytest.mark.parametrize("name", ALL)
def test_all_pinned_raises_then_unpin_frees(name: str) -> None:
    p = make_policy(name)
    insert_all(p, "ab")
    p.pin(k("a"))
    p.pin(k("b"))
    with pytest.raises(NothingToEvict):
        p.evict()
    assert len(p) == 2 and k("a") in p and k("b") in p
    p.unpin(k("b"))
    assert p.evict() == k("b")
    with pytest.raises(NothingToEvict):
        p.evict()
    p.unpin(k("a"))
    assert drain(p) == ["a"]


@pytest.mark.parametrize("name", ALL)
def test_pin_before_insert_is_remembered_and_survives_remove(name: str) -> None:
    p = make_policy(name)
    p.pin(k("x"))
    insert_all(p, "xy")
    assert drain(p) == ["y"]
    p.remove(k("x"))  # removing does not unpin
    assert k("x") not in p and len(p) == 0
    insert_all(p, "zx")
    assert drain(p) == ["z"]
    p.unpin(k("x"))
    p.unpin(k("x"))  # unpinning twice is harmless
    assert drain(p) == ["x"]


@pytest.mark.parametrize("name", ALL)
def test_remove_and_unknown_keys(name: str) -> None:
    p = make_policy(name)
    insert_all(p, "ab")
    p.remove(k("zz"))  # unknown: ignored
    p.access(k("zz"))  # unknown: ignored, and not tracked afterwards
    p.unpin(k("zz"))
    assert k("zz") not in p and len(p) == 2
    p.remove(k("a"))
    p.remove(k("a"))
    assert k("a") not in p and len(p) == 1
    assert drain(p) == ["b"]


@pytest.mark.parametrize("name", ALL)
def test_reinsert_is_an_access(name: str) -> None:
    p = make_policy(name)
    insert_all(p, "ab")
    p.insert(k("a"), 1)  # tracked: counts as a read of a, not a second entry
    assert len(p) == 2
    # LRU: a is now the most recent. S3-FIFO: a was read in S, moves to M; b leaves S first.
    # prefix: a is re-used (rank 3 - 0.25*2), b once-seen (rank 2 - penalty).
    # adaptive: a is re-used, b once-seen and fresh, and q = 0: fresh first.
    assert drain(p) == ["b", "a"]


@pytest.mark.parametrize("name", ALL)
def test_deterministic(name: str) -> None:
    def run() -> list[str]:
        p = make_policy(name)
        for i in range(200):
            p.insert(k(f"{i % 37}"), 1 + i % 3, i % 5, k(f"{(i - 1) % 37}") if i % 5 else b"")
            if i % 3 == 0:
                p.access(k(f"{(i * 7) % 37}"))
            if len(p) > 20:
                p.evict()
        return drain(p)

    assert run() == run()


# --- LRU ---------------------------------------------------------------------------------------
def test_lru_order_and_pins() -> None:
    p = LRUPolicy()
    insert_all(p, "abcd")
    p.access(k("a"))  # order now b c d a
    p.pin(k("c"))
    assert [p.evict() for _ in range(3)] == [k("b"), k("d"), k("a")]
    with pytest.raises(NothingToEvict):
        p.evict()
    insert_all(p, "e")
    p.unpin(k("c"))  # unpinning counts as a use: c goes after e
    assert drain(p) == ["e", "c"]


# --- S3-FIFO -----------------------------------------------------------------------------------
def test_s3fifo_queues() -> None:
    p = S3FIFOPolicy()
    insert_all(p, "abcde")  # S = a b c d e (S is all of the size: evict from S)
    p.access(k("b"))
    assert p.evict() == k("a")  # a unread in S: evicted, ghost remembers it
    # b was read in S: moved to M (freq reset); c unread: evicted.
    assert p.evict() == k("c")
    p.insert(k("a"), 1)  # ghost hit: straight into M, behind b
    p.access(k("b"))  # b: freq 1 in M
    assert p.evict() == k("d")  # S (d e) is still >= 10% of the size
    assert p.evict() == k("e")
    # S is empty: M = b(1) a(0); b is reinserted with freq 0, a goes first.
    assert drain(p) == ["a", "b"]


def test_s3fifo_ghost_is_bounded_and_sizes_count() -> None:
    p = S3FIFOPolicy()
    p.insert(k("big"), 90)
    insert_all(p, "xy")  # S holds all 92 bytes
    assert p.evict() == k("big")
    p.insert(k("m"), 10)
    p.access(k("x"))
    # S = x(1) y m, 12 bytes of 12: x read -> M; y unread -> evicted.
    assert p.evict() == k("y")
    p.insert(k("big"), 90)  # ghost hit: into M, M = x big
    # S = m (10 bytes) < 10% of 101 bytes: evict from M; x (freq 0 since its move) goes first.
    assert p.evict() == k("x")
    assert p.evict() == k("m")  # M = big; S = m is 10 of 100 bytes: >= 10%, S goes first
    assert drain(p) == ["big"]


def test_s3fifo_pins() -> None:
    p = S3FIFOPolicy()
    insert_all(p, "abc")
    p.pin(k("a"))
    assert drain(p) == ["b", "c"]
    p.unpin(k("a"))
    assert drain(p) == ["a"]


# --- property test: any sequence of operations -----------------------------------------------
KEYS = [bytes([i]) for i in range(8)]
_key = st.sampled_from(KEYS)
_op = st.one_of(
    st.tuples(st.just("insert"), _key, st.integers(1, 4), st.sampled_from([b"", *KEYS])),
    st.tuples(st.sampled_from(["access", "remove", "pin", "unpin"]), _key),
    st.tuples(st.just("evict")),
)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_op, max_size=60))
def test_any_op_sequence(name: str, ops: list[tuple]) -> None:
    p = make_policy(name)
    tracked: set[bytes] = set()
    pinned: set[bytes] = set()
    for op in ops:
        kind = op[0]
        if kind == "insert":
            p.insert(op[1], op[2], 1 if op[3] else 0, op[3])
            tracked.add(op[1])
        elif kind == "access":
            p.access(op[1])
        elif kind == "remove":
            p.remove(op[1])
            tracked.discard(op[1])
        elif kind == "pin":
            p.pin(op[1])
            pinned.add(op[1])
        elif kind == "unpin":
            p.unpin(op[1])
            pinned.discard(op[1])
        elif tracked - pinned:
            victim = p.evict()
            assert victim in tracked and victim not in pinned
            tracked.remove(victim)
        else:
            with pytest.raises(NothingToEvict):
                p.evict()
        assert len(p) == len(tracked)
        assert {key for key in KEYS if key in p} == tracked
    victims = [p.evict() for _ in range(len(tracked - pinned))]
    assert sorted(victims) == sorted(tracked - pinned)  # each evictable key, exactly once
    with pytest.raises(NothingToEvict):
        p.evict()
    assert len(p) == len(tracked & pinned)


# --- the default against LRU, out of sample (hit ratio, not speed) -----------------------------
# The default's parameters were chosen on the first half of the shared trace and on the
# generated workloads with seed 0 (kvtier/policies/adaptive.py says so); these checks run on
# what the choice never saw: the trace's second half, and generated seeds 21 and 22.
def _load_replay() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_bench_replay", REPO / "bench" / "replay.py")
    assert spec is not None and spec.loader is not None
    replay = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = replay  # its dataclasses resolve annotations through it
    spec.loader.exec_module(replay)
    return replay


def _vs_lru(replay: ModuleType, requests: list[list[bytes]], pct: int) -> tuple[float, float, float]:
    """(default / LRU, default hit ratio, LRU hit ratio) at ``pct``% of the distinct blocks."""
    cap = max(1, len({key for ids in requests for key in ids}) * pct // 100)
    lru, blocks, _ = replay.replay(requests, make_policy("lru"), cap)
    mine, _, _ = replay.replay(requests, make_policy(DEFAULT_POLICY), cap)
    return (mine / lru if lru else 1.0), mine / blocks, lru / blocks


@pytest.mark.skipif(not TRACE.is_file(), reason=f"trace not found: {TRACE} (../shared/traces/README.md)")
def test_default_beats_lru_on_the_held_out_half_of_the_trace() -> None:
    replay = _load_replay()
    requests = replay.load_trace(TRACE)
    held_out = requests[len(requests) // 2:]
    # 10%: 1.03 since the duel took LFU as its third candidate (1.037 here, 1.068 before; in
    # exchange +2 to +23 points on round-robin chat and docs-QA: tests/test_policy_dueling.py).
    for pct, gain in ((5, 1.05), (10, 1.03), (20, 0.99), (40, 0.99)):
        ratio, mine, lru = _vs_lru(replay, held_out, pct)
        assert ratio >= gain, f"{DEFAULT_POLICY} at {pct}%: {mine:.4f} vs lru {lru:.4f}"


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["chat", "agent", "rag", "scan", "mix", "rounds"])
def test_default_never_loses_to_lru_on_held_out_generated_seeds(workload: str) -> None:
    replay = _load_replay()
    sys.path.insert(0, str(REPO / "bench"))
    import workloads

    for seed in (21, 22):
        requests = replay.as_keys(workloads.generate(workload, seed, scale=0.5))
        for pct in (5, 10, 20, 40):
            ratio, mine, lru = _vs_lru(replay, requests, pct)
            assert ratio >= 0.99, f"{workload} seed {seed} at {pct}%: {mine:.4f} vs lru {lru:.4f}"


def test_replay_refuses_a_malformed_trace_by_line(tmp_path: Path) -> None:
    """Another trace than the shared one: a bad line is named (file:line), never a KeyError."""
    replay = _load_replay()
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "hash_ids": [1, 2, 3]}\n\n{"hash_ids": [1, 2, 4]}\n')
    assert replay.load_trace(good) == [[i.to_bytes(8, "little") for i in ids] for ids in ([1, 2, 3], [1, 2, 4])]
    cases = {'{"input_length": 10}\n': ":1: expected an object", '{"hash_ids": [1]}\nnot json\n': ":2: not JSON",
             '{"hash_ids": [1, -2]}\n': ":1: expected", '{"hash_ids": [true]}\n': ":1: expected",
             "[1, 2]\n": ":1: each line must be a JSON object", "\n": "no request with blocks"}
    for i, (text, message) in enumerate(cases.items()):
        bad = tmp_path / f"bad{i}.jsonl"
        bad.write_text(text)
        with pytest.raises(replay.TraceError, match=message):
            replay.load_trace(bad)
    assert replay.main(["--quick", "--trace", str(bad)]) == 2

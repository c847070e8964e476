"""The prefix-aware policy: leaves first, reuse ranks, history past eviction, pins, bounds.

Every scripted order below is worked out by hand from the policy's documented rules (the
comment next to each says why), so a change of behaviour shows up as a changed victim list.
"""

from __future__ import annotations

import pytest

from kvtier.policies.prefix import PrefixPolicy
from tests.policy_ops import drain, insert_all, k


# --- prefix --------------------------------------------------------------------------------
def test_prefix_evicts_leaves_first() -> None:
    p = PrefixPolicy()
    insert_all(p, "rxy", chain=True)  # r -> x -> y at clock 1, 2, 3
    insert_all(p, "s")  # a lone root at clock 4
    # All once-seen, so oldest first, but only leaves are candidates: y (3) before s (4);
    # then x and r become leaves in turn and are older than s. LRU would evict r first.
    assert drain(p) == ["y", "x", "r", "s"]


def test_prefix_reused_outranks_once_seen() -> None:
    p = PrefixPolicy()
    insert_all(p, "ab")  # clock 1, 2
    p.access(k("a"))  # clock 3: a re-used, rank 3 - 0.25 * (3 - 1) = 2.5
    insert_all(p, "c")  # clock 4, once-seen
    assert drain(p) == ["b", "c", "a"]  # once-seen (oldest first) before any re-used key


def test_prefix_ranks_by_mean_reuse_gap() -> None:
    p = PrefixPolicy()
    insert_all(p, "a")  # clock 1
    insert_all(p, "12345678")  # clock 2..9, once-seen fillers
    insert_all(p, "b")  # clock 10
    p.access(k("b"))  # clock 11: gap 1, rank 11 - 0.25 * 1 = 10.75
    p.access(k("a"))  # clock 12: gap 11, rank 12 - 0.25 * 11 = 9.25
    # a was used last, yet goes before b: it is re-used eleven times more rarely.
    assert drain(p) == list("12345678") + ["a", "b"]


def test_prefix_history_outlives_eviction() -> None:
    p = PrefixPolicy()
    insert_all(p, "a")  # clock 1
    p.access(k("a"))  # clock 2: count 2
    assert p.evict() == k("a")  # the only key; its history goes to the ghost
    insert_all(p, "bca")  # b 3, c 4, a 5 with count 3 from the ghost
    insert_all(p, "d")  # clock 6, once-seen
    # Without the ghost, a would be once-seen at clock 5 and go before d.
    assert drain(p) == ["b", "c", "d", "a"]


def test_prefix_ghost_is_bounded() -> None:
    p = PrefixPolicy(ghost_factor=0.0, ghost_max=0)
    insert_all(p, "a")
    p.access(k("a"))
    assert p.evict() == k("a")
    for i in range(1100):  # push a out of the (minimum-size) ghost
        p.insert(k(f"f{i}"), 1)
        p.evict()
    insert_all(p, "ad")  # a is once-seen again, older than d
    assert drain(p) == ["a", "d"]


def test_prefix_pins() -> None:
    p = PrefixPolicy()
    insert_all(p, "rx", chain=True)
    p.pin(k("x"))  # a pinned child does not protect its parent: r is a candidate
    assert drain(p) == ["r"]
    p.unpin(k("x"))
    assert drain(p) == ["x"]
    insert_all(p, "rx", chain=True)
    p.pin(k("r"))  # a pinned parent stays; its child goes
    assert drain(p) == ["x"]
    assert len(p) == 1 and k("r") in p
    p.unpin(k("r"))
    assert drain(p) == ["r"]


def test_prefix_unpinned_child_makes_parent_interior_again() -> None:
    p = PrefixPolicy()
    insert_all(p, "rx", chain=True)
    p.pin(k("x"))
    p.unpin(k("x"))  # x counts as r's child again, so r is not a leaf
    assert drain(p) == ["x", "r"]


def test_prefix_remove_keeps_children_counted() -> None:
    p = PrefixPolicy()
    insert_all(p, "rx", chain=True)  # r 1, x 2
    p.remove(k("r"))
    assert len(p) == 1
    p.insert(k("r"), 1)  # a tier replaces a chunk by remove + insert: x is r's child again
    assert drain(p) == ["x", "r"]


def test_prefix_remove_middle_frees_parent() -> None:
    p = PrefixPolicy()
    insert_all(p, "rxy", chain=True)  # r 1, x 2, y 3
    p.remove(k("x"))  # r has no tracked child left: it is a leaf (older than y)
    assert drain(p) == ["r", "y"]


def test_prefix_parent_cycle_still_evicts() -> None:
    p = PrefixPolicy()
    p.insert(k("a"), 1, 1, k("b"))
    p.insert(k("b"), 1, 1, k("a"))  # a and b are each other's child: no leaf
    assert drain(p) == ["a", "b"]  # fallback: first tracked unpinned key, then b is a leaf


def test_prefix_heap_stays_bounded() -> None:
    p = PrefixPolicy()
    insert_all(p, "abcdefgh")
    for i in range(20_000):
        p.access(k("abcdefgh"[i % 8]))
    assert len(p._heap) <= 2 * len(p) + 64  # stale entries are compacted away
    assert len(drain(p)) == 8


def test_prefix_rejects_negative_parameters() -> None:
    with pytest.raises(ValueError):
        PrefixPolicy(beta=-1)


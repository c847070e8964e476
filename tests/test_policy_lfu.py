"""``lfu`` (kvtier.policies.lfu), the default's third candidate: scripted victim orders worked
out by hand from its rules (leaf first; fewest reads and inserts first, ties to the oldest
candidate; counts survive eviction in the ghost). The contract (pins, determinism, any op
sequence) is checked for every registered policy in tests/test_policy.py."""

from __future__ import annotations

import pytest

from kvtier.policies import LFUPolicy, LRUPolicy, PrefixPolicy
from kvtier.policies.ranked import RankedLeafTree
from tests.policy_ops import Cache, drain, insert_all, k


def test_fewest_uses_go_first_ties_oldest_first() -> None:
    p = LFUPolicy()
    insert_all(p, "abcd")
    p.access(k("a"))
    p.access(k("a"))
    p.access(k("c"))
    # b and d were used once (b is older), c twice, a three times.
    assert drain(p) == ["b", "d", "c", "a"]


def test_a_prefix_is_trimmed_from_its_tail_even_at_equal_counts() -> None:
    """A chain inserted in one request: every key used once; ties by age would evict the
    head first and orphan the rest, leaf first takes the tail."""
    p = LFUPolicy()
    insert_all(p, "xyz", chain=True)
    assert drain(p) == ["z", "y", "x"]


def test_a_count_survives_eviction_in_the_ghost() -> None:
    """``h`` is read 3 times, evicted (the only candidate), then inserted again: it resumes
    at 5 uses and outlives the newer ``n`` (1 use), which LRU or a count reset would not."""
    p = LFUPolicy()
    p.insert(k("h"), 1)
    for _ in range(3):
        p.access(k("h"))
    assert p.evict() == k("h")
    p.insert(k("n"), 1)
    p.insert(k("h"), 1)
    assert drain(p) == ["n", "h"]


def test_it_keeps_the_often_read_prefixes_of_a_cycle_larger_than_the_cache() -> None:
    """Four 2-block prompts behind no shared prefix, read in turn, in a 6-block cache, with
    prompt ``a`` read twice per round: LRU hits ``a`` only on its second read of a round (78
    blocks in 20 rounds), lfu keeps ``a`` across rounds and a second prompt part of the time."""
    rounds = [["a1", "a2"], ["b1", "b2"], ["a1", "a2"], ["c1", "c2"], ["d1", "d2"]] * 20
    lfu, lru = Cache(LFUPolicy(), 6), Cache(LRUPolicy(), 6)
    got = sum(lfu.request(r) for r in rounds)
    base = sum(lru.request(r) for r in rounds)
    assert (got, base) == (97, 78)


@pytest.mark.parametrize("policy", [LFUPolicy, PrefixPolicy])
def test_an_eviction_that_rebuilds_the_heap_still_takes_the_lowest_rank(policy: type[RankedLeafTree]) -> None:
    """A re-queue inside ``evict`` may rebuild the heap (stale entries of removed keys pile up
    without evictions): the loop kept popping the old list and returned the most-read key.
    Both policies on kvtier.policies.ranked's heap (by count; by recency and reuse gaps)."""
    p = policy()
    keys = [b"k%04d" % i for i in range(1000)]
    for key in keys:
        p.insert(key, 1)
    for key in keys[1:400]:
        p.access(key)
    for _ in range(10):
        p.access(keys[0])
    for key in keys[400:]:
        p.remove(key)  # 600 stale heap entries: the next re-queue rebuilds it
    assert p.evict() == keys[1]  # read twice, the oldest such; keys[0] was read 11 times

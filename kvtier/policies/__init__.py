"""Eviction policies: pure bookkeeping, no I/O, no locks (the owning tier serialises calls).

A policy tracks keys and picks victims; it never sees bytes. Every policy supports pinning:
a pinned key is never chosen as a victim (hot system prompts). The full contract is in
:mod:`kvtier.policies.base`; this package's root is the registry every tier builds its policy
from, and each policy has a module of its own.

Policies (hit ratios on the replayed Mooncake trace and generated workloads:
``python bench/replay.py --workload all``):
- ``dueling`` (default): ``adaptive``, ``s3fifo`` or ``lfu``, whichever miniature simulations
  of the three on a sample of the keys say wins on the workload running now
  (:mod:`kvtier.policies.dueling`).
- ``adaptive``: prefix-aware, leaf-first, adapting ARC-style between once-seen-first and
  recency, and predicting per parent whether a new child will be read again
  (:mod:`kvtier.policies.adaptive`); thrashes on cyclic reuse just larger than the cache.
- ``prefix``: prefix-aware, leaf-first, once-seen first, ranked by recency and mean reuse gap,
  with a ghost history (:mod:`kvtier.policies.prefix`); wins on the shared trace, loses to LRU
  on chat.
- ``s3fifo``: S3-FIFO whose small queue evicts an unread prefix subtree first
  (:mod:`kvtier.policies.s3fifo`).
- ``lfu``: leaf-first least frequently used, counts kept in a ghost history
  (:mod:`kvtier.policies.lfu`); wins where popularity is stable and skewed or a cyclic working
  set is larger than the cache, loses badly on agents and chat at 10% and more.
- ``lru``: least recently used, the baseline every other policy is measured against
  (:mod:`kvtier.policies.lru`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.base import EvictionPolicy, NothingToEvict
from kvtier.policies.dueling import DuelingPolicy
from kvtier.policies.lfu import LFUPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.prefix import PrefixPolicy
from kvtier.policies.s3fifo import S3FIFOPolicy

__all__ = [
    "DEFAULT_POLICY", "AdaptivePolicy", "DuelingPolicy", "POLICIES", "EvictionPolicy", "LFUPolicy", "LRUPolicy",
    "NothingToEvict",
    "PrefixPolicy", "S3FIFOPolicy", "make_policy",
]


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "s3fifo": S3FIFOPolicy,
    "prefix": PrefixPolicy,
    "adaptive": AdaptivePolicy,
    "dueling": DuelingPolicy,
}
DEFAULT_POLICY = "dueling"


def make_policy(name: str = DEFAULT_POLICY) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; expected one of {sorted(POLICIES)}") from None

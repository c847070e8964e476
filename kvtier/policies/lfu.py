"""Leaf-first LFU with history (``"lfu"``): the default policy's third candidate
(:mod:`kvtier.policies.dueling` follows it where its miniature wins).

Why. ``adaptive`` and ``s3fifo`` rank by recency (and a little frequency: s3fifo's reads are
capped at 3), and both lose where *how often*, not how recently, a prefix was read predicts its
next read: questions over a document corpus with a stable, skewed popularity (the generated
``docqa``: LFU 0.434 against the old default's 0.408 at 5%, seeds 0-2, medians), chat served
round-robin over more conversations than the cache holds (``rrchat`` at 20%: 0.395 against
0.151; a conversation's early turns are read once per later turn, so counts single out the
long conversations worth keeping, and a fixed subset of a cyclic working set hits while
recency thrashes), and tiny caches (2-5% of the distinct blocks) under chat, agents and scans.
It loses badly elsewhere (agents at 10%: 0.54 against 0.87), which is what the duel is for.

Rules:

1. **Leaf first**, as in :mod:`kvtier.policies.adaptive`: only a key with no tracked, unpinned
   child is a candidate, so a prefix is trimmed from its tail. (Counts alone nearly order a
   prefix, a parent being read whenever a child is, but at equal counts a parent inserted
   just before its child would go first and orphan it.)
2. **Rank** = the key's reads and inserts (``count``), lowest evicted first; ties go to the
   key that became a candidate longest ago.
3. **History outlives residency**: an evicted or removed key's count goes to a FIFO ghost of
   ``ghost_factor`` times the tracked keys (at least 1024, at most ``ghost_max``); a key
   inserted again resumes its count. The ghost's bound is the only aging: a key gone longer
   than that starts again from 1. (Dynamic aging, LFU-DA's rank = count + the last victim's
   rank, gave up most of the gain on round-robin chat: 0.18 against 0.39 at 20%, seed 0.)

``size`` is ignored when ranking (as in the other candidates: a chunk's recompute cost grows
with its size). A re-insert of a tracked key is an access (a new ``parent`` is ignored); a
pinned child does not protect its parent; parent links that form a cycle fall back to a linear
scan. Purity, determinism, threads and pins as in :mod:`kvtier.policies.base`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.ranked import RankedLeafTree

DEFAULT_GHOST_FACTOR = 8.0
DEFAULT_GHOST_MAX = 1 << 20


class _Node:
    """One tracked key. ``seq`` names its live heap entry (-1: not a candidate) and ``queued``
    the count that entry carries; ``count`` may have grown since (see :mod:`kvtier.policies.ranked`)."""

    __slots__ = ("count", "parent", "queued", "seq")

    def __init__(self, parent: bytes, count: int) -> None:
        self.parent = parent
        self.count = count
        self.queued = count
        self.seq = -1


class LFUPolicy(RankedLeafTree):
    """Leaf-first least frequently used, counts kept in a ghost history."""

    name = "lfu"

    def __init__(self, *, ghost_factor: float = DEFAULT_GHOST_FACTOR,
                 ghost_max: int = DEFAULT_GHOST_MAX) -> None:
        if ghost_factor < 0 or ghost_max < 0:
            raise ValueError("LFUPolicy: ghost_factor and ghost_max must be >= 0")
        self._ghost_factor = ghost_factor
        self._ghost_max = ghost_max
        self._nodes: dict[bytes, _Node] = {}
        # parent key -> tracked, unpinned children (the count survives the parent's
        # remove + re-insert)
        self._kids: dict[bytes, int] = {}
        self._pinned: set[bytes] = set()
        self._heap: list[tuple[int, int, bytes]] = []  # (count, seq, key); stale entries lazy
        self._ghost: OrderedDict[bytes, int] = OrderedDict()  # key -> its count when it left
        self._seq = 0

    def _rank_of(self, n: _Node) -> int:
        return n.count

    def _ghost_entry(self, n: _Node) -> int:
        return n.count

    # --- the contract ----------------------------------------------------------------------
    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        if key in self._nodes:
            self.access(key)
            return
        node = _Node(parent if parent != key else b"", self._ghost.pop(key, 0) + 1)
        self._nodes[key] = node
        if key not in self._pinned:
            self._enter(key, node)

    def access(self, key: bytes) -> None:
        node = self._nodes.get(key)
        if node is not None:
            # The count only grows: a queued entry stays and is re-queued lazily when it
            # reaches the heap's top, so a hot key costs no push per read.
            node.count += 1

    def forget_evicted(self, key: bytes) -> None:
        """Another policy tracking the same keys evicted ``key`` (kvtier.policies.dueling):
        an eviction here leaves what a removal does (its count in the ghost)."""
        self.remove(key)

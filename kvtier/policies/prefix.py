"""Prefix-aware reuse-interval eviction (``"prefix"``): once-seen first, then reuse gaps.

The default, :mod:`kvtier.policies.adaptive`, falls back to these rules where they pay and to
recency where they do not (in a chat, the newest turn is once-seen until the next turn reads
it, and once-seen-first evicts it: ``bench/replay.py --workload chat``).

Why not LRU. A lookup counts only the *leading* run of chunk hits, so a chunk is worth keeping
only while its whole prefix is kept, and the deepest chunk of a prefix is the one to give up
first. In replayed traces (``bench/replay.py`` on the Mooncake trace) most chunks are read once,
while prefixes that are re-read come back after gaps several times the cache size: recency
alone keeps the wrong chunks, and so does raw frequency (popularity drifts).

The rules, each measured on that replay (see the bench's table for the figures):

1. **Leaf first.** Only a chunk with no tracked, unpinned child is a candidate. A prefix is
   trimmed from its tail, so what is left of it still hits; an ancestor goes only once its
   descendants are gone (children are counted by the ``parent`` key given to ``insert``).
2. **Rank** (lowest evicted first), fixed when a key is touched, so a heap orders candidates:
   - seen once: ``last - single_penalty``: every once-seen chunk goes before any re-used one,
     oldest first (scan resistance: a flood of new prompts cannot flush the re-used set);
   - seen ``c >= 2`` times: ``last - beta * (last - first) / (c - 1)``, the last use moved back
     by a fraction of the mean reuse gap. Between LRU (``beta = 0``) and LRU-2 (``beta`` ~ 1):
     a chunk reused at short intervals outranks one reused rarely, and both age with the clock.
3. **History outlives residency.** When a key leaves (evicted or removed) its first-use time and
   count go to a bounded FIFO ghost, so a chunk read again after eviction comes back as
   "re-used". Reuse gaps here are several cache sizes long, hence a ghost of ``ghost_factor``
   (8) times the tracked keys; it is capped at ``ghost_max`` entries (~200 bytes each).

``size`` is ignored when ranking: a KV chunk's recompute cost grows with its size, so the value
per byte of a hit does not depend on it. The clock is logical (one tick per insert or access).

Known limits: a re-insert of a tracked key is an access (a new ``parent`` is ignored); children
of a removed key are not hunted down (a tier replaces a chunk by remove + insert, after which
the children are whole again); a pinned child does not protect its parent (pin whole prefixes).
Parent links that form a cycle (impossible with chained hashes) fall back to a linear scan.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.ranked import RankedLeafTree

#: Weight of the mean reuse gap in the rank; 0.15-0.3 all score within ~3% on the replay.
DEFAULT_BETA = 0.25
#: Ghost entries kept per tracked key; 4 loses ~3% of hits at the smallest cache, 16 gains ~1%.
DEFAULT_GHOST_FACTOR = 8.0
DEFAULT_GHOST_MAX = 1 << 20
#: Ticks a once-seen chunk is ranked behind its last use: "always first" for any real run.
DEFAULT_SINGLE_PENALTY = float(1 << 40)


class _Node:
    """One tracked key. ``seq`` names its live heap entry (-1: not a candidate), ``queued`` is
    the rank that entry carries; ``rank`` may have grown since (see :mod:`kvtier.policies.ranked`)."""

    __slots__ = ("count", "first", "last", "parent", "queued", "rank", "seq")

    def __init__(self, parent: bytes, first: int, last: int, count: int) -> None:
        self.parent = parent
        self.first = first
        self.last = last
        self.count = count
        self.rank = 0.0
        self.queued = 0.0
        self.seq = -1


class PrefixPolicy(RankedLeafTree):
    """Leaf-first eviction ranked by recency and mean reuse gap, with a ghost history."""

    name = "prefix"

    def __init__(self, *, beta: float = DEFAULT_BETA, ghost_factor: float = DEFAULT_GHOST_FACTOR,
                 ghost_max: int = DEFAULT_GHOST_MAX,
                 single_penalty: float = DEFAULT_SINGLE_PENALTY) -> None:
        if beta < 0 or ghost_factor < 0 or ghost_max < 0 or single_penalty < 0:
            raise ValueError("PrefixPolicy parameters must be >= 0")
        self._beta = beta
        self._ghost_factor = ghost_factor
        self._ghost_max = ghost_max
        self._single_penalty = single_penalty
        self._nodes: dict[bytes, _Node] = {}
        # parent key -> number of tracked, unpinned children (the parent may be untracked:
        # the count survives its remove + re-insert).
        self._kids: dict[bytes, int] = {}
        self._pinned: set[bytes] = set()
        self._heap: list[tuple[float, int, bytes]] = []  # (rank, seq, key), stale entries lazy
        self._ghost: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key -> (first, count)
        self._clock = 0
        self._seq = 0

    # --- ranking and the candidate heap ----------------------------------------------------
    def _rank(self, n: _Node) -> float:
        if n.count < 2:
            return n.last - self._single_penalty
        return n.last - self._beta * (n.last - n.first) / (n.count - 1)

    def _rank_of(self, n: _Node) -> float:
        return n.rank  # kept current by insert and access

    def _ghost_entry(self, n: _Node) -> tuple[int, int]:
        return (n.first, n.count)

    def _is_candidate(self, key: bytes) -> bool:
        return key not in self._pinned and not self._kids.get(key)

    # --- the contract ----------------------------------------------------------------------
    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        node = self._nodes.get(key)
        if node is not None:
            self.access(key)
            return
        self._clock += 1
        past = self._ghost.pop(key, None)
        if past is None:
            node = _Node(parent if parent != key else b"", self._clock, self._clock, 1)
        else:
            node = _Node(parent if parent != key else b"", past[0], self._clock, past[1] + 1)
        node.rank = self._rank(node)
        self._nodes[key] = node
        if key not in self._pinned:
            self._enter(key, node)

    def access(self, key: bytes) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        self._clock += 1
        node.last = self._clock
        node.count += 1
        node.rank = self._rank(node)
        # A touch raises the rank whenever beta < 2 (always, by default): the queued entry
        # then stays and is re-queued lazily when it reaches the top, so a hot key costs no
        # heap push per read. A rank that fell needs a fresh entry now.
        if (node.seq < 0 or node.rank < node.queued) and self._is_candidate(key):
            self._push(key, node)

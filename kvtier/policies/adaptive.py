"""Adaptive prefix-aware eviction (``"adaptive"``): the default policy's first candidate
(:mod:`kvtier.policies.dueling` runs it against S3-FIFO and follows the winner).

Why adaptive. Two rules each win on one kind of workload and lose on another
(``python bench/replay.py --workload all``):

- *Once-seen first* (the ``prefix`` policy): most blocks of a trace of independent requests are
  read once, so evicting every once-seen block before any re-used one keeps the re-used set
  (and resists scans). In a chat, though, the blocks of each conversation's newest turn are
  once-seen until the user's next turn, which is exactly when they are needed: once-seen-first
  throws them away and loses to LRU (by ~8% at 10-40% capacity on the generated chat trace).
  Leaf-first is not the culprit: on that chat (seed 0), leaf-first recency alone scores 0.337 /
  0.735 / 0.838 at 10 / 20 / 40% (LRU 0.324 / 0.732 / 0.838), once-seen-first alone 0.380 /
  0.691 / 0.772, both (``prefix``) 0.408 / 0.694 / 0.772.
- *Recency* (LRU order, leaf first) is right for chat and agents, wrong for the shared trace.

So, as in ARC (Megiddo and Modha, FAST '03), the policy learns from its own mistakes how much
room to give once-seen keys. Keys live in three sets:

- **fresh**: seen once, and its request shared no tracked prefix (its parent is untracked or
  itself fresh) or its parent predicts it dead (rule 5): a one-shot prompt, a scan, the first
  request of a new document, a RAG question behind a document whose questions never recur;
- **continuation**: seen once, extending a prefix that was re-used or itself a continuation
  and whose last key predicts its new children live (rule 5): the newest turn of a chat, an
  agent's newest step, a new question after a shared prompt;
- **re-used** (T2): seen twice or more, counting history kept after eviction.

1. **Leaf first.** Only a key with no tracked, unpinned child is a candidate (a prefix is
   trimmed from its tail, so what is left of it still hits); each set keeps its candidates in
   a heap ordered by rank (once-seen: last use; re-used: last use moved back by ``beta``
   times the mean reuse gap, so a key reused rarely goes before one reused often).
2. **Victim.** While the fresh set holds more than ``q`` keys, its lowest candidate goes;
   else while the continuation set holds more than ``p``, its lowest goes; otherwise the
   lowest of the three heaps' tops (recency between the sets). ``p = q = 0`` is
   once-seen-first (the ``prefix`` policy's rule); ``p, q >= len`` is leaf-first recency.
3. **Adaptation.** An evicted key leaves a ghost (its history and the set it left). If it is
   inserted again within ``len`` evictions (it would have hit in a cache twice the size), the
   set it left was too small: a fresh ghost raises ``q``, a continuation ghost raises ``p``,
   a re-used ghost lowers both. Steps are ``max(1, len / step_div)`` keys for ``p`` and
   ``max(1, len / fresh_step_div)`` for ``q``, times ARC's balance factor (the other sets'
   share of recent evictions over this set's, at least 1: a regret from a set that is rarely
   evicted from weighs more). Both start at 0 and stay in ``[0, len]``.
4. **History outlives residency.** Ghosts are a FIFO of ``ghost_factor`` times the tracked
   keys (at most ``ghost_max``): a key read again after a long gap comes back as re-used.

5. **Child-reuse prediction** (after SHiP, Wu et al., MICRO '11, with the parent key as the
   signature). Each key keeps a score in ``[-score_cap, score_cap]``: +1 when one of its
   once-seen children is read again, -1 when one is evicted unread; the score survives in the
   ghost. A new key under a parent with a negative score, or with score 0 that already had
   children, is predicted dead and goes to the fresh set (evicted first while it is over
   ``q``); a never-branched leaf (a chat turn extending the previous turn) keeps the plain rule.
   Why: in the generated ``mix`` at 10% capacity most continuation keys were RAG questions and
   long-tail documents (7% of them ever came back) crowding out chat turns (56% came back),
   because both shared ``p``; the prediction took the mix at 10% from 1.018/1.020/1.021x to
   1.049/1.053/1.056x LRU (min/median/max, seeds 0-2; Belady 1.094-1.099x), the RAG and chat
   classes both gaining, at a cost on the whole shared trace at 5% (1.073x -> 1.057x LRU). Frequency in the re-used rank (a log-count
   bonus), another ``beta`` and ghost sizes 2-32x did not help there (measured, not kept).

Scan resistance: a scan is fresh keys that never return, so it raises no regret and leaves
``q`` where it was; once the fresh set is over ``q`` the scan evicts itself, costing the
working set at most ``q`` keys (``tests/test_policy_adaptive.py`` measures it against LRU).

``size`` is ignored when ranking (a chunk's recompute cost grows with its size). The clock is
logical (one tick per insert or access). Known limits, as for ``prefix``: a re-insert of a
tracked key is an access (a new ``parent`` is ignored); a pinned child does not protect its
parent; parent links that form a cycle fall back to a linear scan. Purity, threads and the
pin rules are those of :mod:`kvtier.policies.base`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvtier.policies.base import NothingToEvict
from kvtier.policies.tree import LeafTree

DEFAULT_BETA = 0.25
#: Regrets for ``p`` (continuation set) and ``q`` (fresh set) to cross their whole range,
#: before the balance factor of rule 3. Chosen among 64-2048 on the generated workloads
#: (seed 0) and the first half of the shared trace: ``q`` must move slowly (64 chases noise
#: there and loses the once-seen-first gain), ``p`` may move fast (chat wants recency soon).
DEFAULT_STEP_DIV = 64.0
DEFAULT_FRESH_STEP_DIV = 1024.0
DEFAULT_GHOST_FACTOR = 8.0
DEFAULT_GHOST_MAX = 1 << 20
#: Bound of a key's child-reuse score (rule 5); 2 loses ~1% on the mix at 10%, 8-32 are equal.
DEFAULT_SCORE_CAP = 8
_GHOST_MIN = 1024
_FRESH, _CONT, _T2 = 0, 1, 2  # the sets: once-seen fresh, once-seen continuation, re-used
_REMOVED = -1  # ghost origin of a key the user removed: its return is no regret


def _balance(others: float, mine: float) -> float:
    """ARC's step factor: a regret from a set that is evicted from rarely weighs more."""
    return max(1.0, others / mine) if mine > 0 else 1.0


class _Node:
    """One tracked key. ``seq`` names its live heap entry (-1: not a candidate) and ``queued``
    the rank that entry carries; ``rank`` may have grown since (see ``AdaptivePolicy._top``).
    ``score`` and ``branched`` are its children's record (rule 5): reads minus deaths of
    once-seen children, and whether any child was ever inserted under it."""

    __slots__ = ("count", "first", "kind", "last", "parent", "queued", "rank", "score",
                 "seq", "branched")

    def __init__(self, parent: bytes, first: int, last: int, count: int, kind: int) -> None:
        self.parent = parent
        self.kind = kind
        self.first = first
        self.last = last
        self.count = count
        self.rank = 0.0
        self.queued = 0.0
        self.seq = -1
        self.score = 0
        self.branched = False


class AdaptivePolicy(LeafTree):
    """Leaf-first eviction that adapts between once-seen-first and recency (ARC-style)."""

    name = "adaptive"

    def __init__(self, *, beta: float = DEFAULT_BETA, step_div: float = DEFAULT_STEP_DIV,
                 fresh_step_div: float = DEFAULT_FRESH_STEP_DIV,
                 ghost_factor: float = DEFAULT_GHOST_FACTOR,
                 ghost_max: int = DEFAULT_GHOST_MAX, score_cap: int = DEFAULT_SCORE_CAP) -> None:
        if (beta < 0 or min(step_div, fresh_step_div) <= 0 or ghost_factor < 0 or ghost_max < 0
                or score_cap < 1):
            raise ValueError("AdaptivePolicy: beta, ghost_factor, ghost_max must be >= 0, "
                             "step_div and fresh_step_div > 0, score_cap >= 1")
        self._beta = beta
        self._score_cap = score_cap
        self._step_div = step_div
        self._fresh_step_div = fresh_step_div
        self._recent = [0.0, 0.0, 0.0]  # evictions per set among about the last len ones
        self._ghost_factor = ghost_factor
        self._ghost_max = ghost_max
        self._nodes: dict[bytes, _Node] = {}
        # parent key -> tracked, unpinned children (the count survives the parent's
        # remove + re-insert).
        self._kids: dict[bytes, int] = {}
        self._pinned: set[bytes] = set()
        # One candidate heap per set: (rank, seq, key); stale entries are skipped lazily.
        self._heaps: list[list[tuple[float, int, bytes]]] = [[], [], []]
        # key -> (first use, uses, set it left or _REMOVED, eviction number when it left,
        # child-reuse score)
        self._ghost: OrderedDict[bytes, tuple[int, int, int, int, int]] = OrderedDict()
        self._n = [0, 0, 0]  # tracked keys per set (pinned and interior ones included)
        self._p = 0.0  # target size of the continuation set
        self._q = 0.0  # target size of the fresh set
        self._clock = 0
        self._seq = 0
        self._evictions = 0

    @property
    def target(self) -> float:
        """``p``: how many once-seen continuation keys may be kept before they go first."""
        return self._p

    @property
    def fresh_target(self) -> float:
        """``q``: how many once-seen fresh keys may be kept before they go first."""
        return self._q

    # --- ranking and the candidate heaps ---------------------------------------------------
    def _rank(self, n: _Node) -> float:
        if n.kind != _T2:
            return float(n.last)
        return n.last - self._beta * (n.last - n.first) / (n.count - 1)

    def _push(self, key: bytes, n: _Node) -> None:
        """Make ``n`` a candidate in its set's heap (any older entry goes stale)."""
        self._seq += 1
        n.seq = self._seq
        n.queued = n.rank
        heap = self._heaps[n.kind]
        heapq.heappush(heap, (n.rank, n.seq, key))
        if len(heap) > 2 * len(self._nodes) + 64:
            # Stale entries pile up only without evictions to pop them; rebuild this heap.
            heap[:] = [(m.queued, m.seq, k) for k, m in self._nodes.items()
                       if m.seq >= 0 and m.kind == n.kind]
            heapq.heapify(heap)

    def _top(self, heap: list[tuple[float, int, bytes]]) -> tuple[float, int, bytes] | None:
        """The heap's true minimum, after dropping stale entries and re-queuing touched keys:
        ranks only grow while a key stays in its set, so a current top entry is the minimum."""
        nodes = self._nodes
        while heap:
            entry = heap[0]
            node = nodes.get(entry[2])
            if node is None or node.seq != entry[1]:
                heapq.heappop(heap)
            elif node.rank != node.queued:
                heapq.heappop(heap)
                self._push(entry[2], node)
            else:
                return entry
        return None

    def _adapt(self, origin: int, evicted_at: int) -> None:
        size = len(self._nodes)
        if origin == _REMOVED or self._evictions - evicted_at > size:
            return  # removed by the user, or gone too long for a bigger set to have kept it
        step = max(1.0, size / self._step_div)
        fresh_step = max(1.0, size / self._fresh_step_div)
        r = self._recent
        if origin == _T2:
            self._p = max(0.0, self._p - step * _balance(r[_CONT], r[_T2]))
            self._q = max(0.0, self._q - fresh_step * _balance(r[_FRESH], r[_T2]))
        elif origin == _CONT:
            self._p = min(float(size), self._p + step * _balance(r[_FRESH] + r[_T2], r[_CONT]))
        else:
            self._q = min(float(size), self._q + fresh_step * _balance(r[_CONT] + r[_T2], r[_FRESH]))

    # --- the contract ----------------------------------------------------------------------
    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        if key in self._nodes:
            self.access(key)
            return
        self._clock += 1
        parent = parent if parent != key else b""
        past = self._ghost.pop(key, None)
        if past is None:
            pn = self._nodes.get(parent) if parent else None
            # Rule 5: a parent whose once-seen children die (or, unknown, a fan-out node that
            # already had one) predicts this one dead too: fresh, evicted first.
            kind = (_CONT if pn is not None and pn.kind != _FRESH
                    and (pn.score > 0 or (pn.score == 0 and not pn.branched)) else _FRESH)
            if pn is not None:
                pn.branched = True
            node = _Node(parent, self._clock, self._clock, 1, kind)
        else:
            node = _Node(parent, past[0], self._clock, past[1] + 1, _T2)
            node.score = past[4]
            self._adapt(past[2], past[3])
        node.rank = self._rank(node)
        self._nodes[key] = node
        self._n[node.kind] += 1
        if key not in self._pinned:
            self._enter(key, node)

    def access(self, key: bytes) -> None:
        node = self._nodes.get(key)
        if node is None:
            return
        self._clock += 1
        node.last = self._clock
        node.count += 1
        moved = node.kind != _T2  # once-seen -> T2: its old entry goes stale, it needs a new one
        if moved:  # a once-seen child read again: rule 5's +1 for its parent
            pn = self._nodes.get(node.parent) if node.parent else None
            if pn is not None and pn.score < self._score_cap:
                pn.score += 1
            self._n[node.kind] -= 1
            self._n[_T2] += 1
            node.kind = _T2
        node.rank = self._rank(node)
        # Within a set a touch raises the rank (beta < 2): the queued entry stays and is
        # re-queued lazily when it reaches the top, so a hot key costs no push per read.
        if (moved or node.seq < 0 or node.rank < node.queued) and self._candidate(key):
            self._push(key, node)

    def _candidate(self, key: bytes) -> bool:
        return key not in self._pinned and not self._kids.get(key)

    def remove(self, key: bytes) -> None:
        node = self._nodes.pop(key, None)
        if node is not None:
            self._forget(key, node, _REMOVED)

    def _forget(self, key: bytes, node: _Node, origin: int) -> None:
        """Bookkeeping for a key that stopped being tracked; its history goes to the ghost."""
        node.seq = -1
        self._n[node.kind] -= 1
        if node.parent and key not in self._pinned:
            self._child_gone(node.parent)
        ghost = self._ghost
        ghost[key] = (node.first, node.count, node.kind if origin != _REMOVED else _REMOVED,
                      self._evictions, node.score)
        size = len(self._nodes)
        limit = min(self._ghost_max, max(_GHOST_MIN, int(self._ghost_factor * size)))
        while len(ghost) > limit:
            ghost.popitem(last=False)
        if self._p > size:
            self._p = float(size)
        if self._q > size:
            self._q = float(size)

    def evict(self) -> bytes:
        top, heaps, n = self._top, self._heaps, self._n
        fresh, cont, reused = top(heaps[_FRESH]), top(heaps[_CONT]), top(heaps[_T2])
        if fresh is not None and n[_FRESH] > self._q:
            origin = _FRESH
        elif cont is not None and n[_CONT] > self._p:
            origin = _CONT
        else:
            # Recency between the sets' tops (ties: fresh, then continuation, then re-used).
            origin, best = -1, 0.0
            for kind, entry in ((_FRESH, fresh), (_CONT, cont), (_T2, reused)):
                if entry is not None and (origin < 0 or entry[0] < best):
                    origin, best = kind, entry[0]
            if origin < 0:
                return self._evict_without_leaf()
        key = heapq.heappop(heaps[origin])[2]
        self._evicted(key, self._nodes.pop(key), origin)
        return key

    def _evicted(self, key: bytes, node: _Node, origin: int) -> None:
        """Bookkeeping for ``key``, evicted from set ``origin`` (and already out of the index)."""
        if origin != _T2 and node.parent:  # a once-seen child died unread: rule 5's -1
            pn = self._nodes.get(node.parent)
            if pn is not None and pn.score > -self._score_cap:
                pn.score -= 1
        self._count_eviction(origin)
        self._forget(key, node, origin)

    def forget_evicted(self, key: bytes) -> None:
        """Another policy tracking the same keys evicted ``key`` (kvtier.policies.dueling):
        stop tracking it as if this one had evicted it, so its ghost and the regrets it may
        raise stay what an eviction leaves (``remove`` would leave a ghost that teaches
        nothing). Unknown keys are ignored."""
        node = self._nodes.pop(key, None)
        if node is not None:
            self._evicted(key, node, node.kind)

    def _count_eviction(self, origin: int) -> None:
        self._evictions += 1
        keep = 1.0 - 1.0 / (len(self._nodes) + 1)
        recent = self._recent
        recent[0] *= keep
        recent[1] *= keep
        recent[2] *= keep
        recent[origin] += 1.0

    def _evict_without_leaf(self) -> bytes:
        """No leaf is left: every tracked key is pinned, or parent links form a cycle."""
        for key in self._nodes:
            if key not in self._pinned:
                node = self._nodes.pop(key)
                self._count_eviction(node.kind)
                self._forget(key, node, node.kind)
                return key
        raise NothingToEvict("every tracked key is pinned")

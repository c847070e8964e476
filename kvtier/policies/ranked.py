"""A leaf-first tree whose candidates sit in one lazy min-heap, with a ghost history: the
machinery shared by ``prefix`` and ``lfu`` (they differ only in what a key's rank is and what
its ghost keeps).

Each candidate (an unpinned leaf) has one live heap entry ``(queued, seq, key)``; ``seq``
names it (-1: not a candidate), so entries of keys that left, gained a child or a pin go
stale and are skipped when popped. A rank may only grow between pushes (a touch), so an entry
is a lower bound of its key's rank: ``evict`` re-queues a popped entry whose rank grew and
takes the heap's top once its entry is current. Stale entries pile up only without evictions
to pop them; past twice the tracked keys the heap is rebuilt from the live ones.

When a key stops being tracked (evicted or removed) ``_ghost_entry(node)`` goes to a FIFO
ghost of ``ghost_factor`` times the tracked keys (at least :data:`GHOST_MIN`, at most
``ghost_max``), which the subclass reads back when the key is inserted again.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any

from kvtier.policies.base import NothingToEvict
from kvtier.policies.tree import LeafTree

GHOST_MIN = 1024


class RankedLeafTree(LeafTree):
    """The subclass defines ``_rank_of(node)`` (its current rank, lowest evicted first) and
    ``_ghost_entry(node)``, and sets ``_heap = []``, ``_seq = 0``, ``_ghost = OrderedDict()``,
    ``_ghost_factor`` and ``_ghost_max``; nodes carry ``parent``, ``seq`` and ``queued``."""

    _heap: list[tuple[Any, int, bytes]]
    _seq: int
    _ghost: OrderedDict[bytes, Any]
    _ghost_factor: float
    _ghost_max: int

    def _rank_of(self, node: Any) -> Any:
        raise NotImplementedError

    def _ghost_entry(self, node: Any) -> Any:
        raise NotImplementedError

    def _push(self, key: bytes, n: Any) -> None:
        """Make ``n`` a candidate with its current rank (any older entry goes stale)."""
        self._seq += 1
        n.seq = self._seq
        n.queued = self._rank_of(n)
        heapq.heappush(self._heap, (n.queued, n.seq, key))
        if len(self._heap) > 2 * len(self._nodes) + 64:
            self._heap = [(m.queued, m.seq, k) for k, m in self._nodes.items() if m.seq >= 0]
            heapq.heapify(self._heap)

    def remove(self, key: bytes) -> None:
        node = self._nodes.pop(key, None)
        if node is not None:
            self._forget(key, node)

    def _forget(self, key: bytes, node: Any) -> None:
        """Bookkeeping for a key that stopped being tracked; its history goes to the ghost."""
        node.seq = -1
        if node.parent and key not in self._pinned:
            self._child_gone(node.parent)
        ghost = self._ghost
        ghost[key] = self._ghost_entry(node)
        limit = min(self._ghost_max, max(GHOST_MIN, int(self._ghost_factor * len(self._nodes))))
        while len(ghost) > limit:
            ghost.popitem(last=False)

    def evict(self) -> bytes:
        nodes = self._nodes
        # self._heap each time round: a re-queue below may rebuild it into a new list.
        while self._heap:
            _, seq, key = heapq.heappop(self._heap)
            node = nodes.get(key)
            if node is None or node.seq != seq:
                continue  # stale entry
            if self._rank_of(node) != node.queued:
                self._push(key, node)  # touched since it was queued: its entry is current now
                continue
            del nodes[key]
            self._forget(key, node)
            return key
        # No leaf is left: every tracked key is pinned, or parent links form a cycle.
        for key in nodes:
            if key not in self._pinned:
                node = nodes.pop(key)
                self._forget(key, node)
                return key
        raise NothingToEvict("every tracked key is pinned")

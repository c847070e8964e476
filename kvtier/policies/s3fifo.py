"""S3-FIFO (Yang et al., SOSP '23), subtree first in S: the default's second candidate
(:mod:`kvtier.policies.dueling` follows it where it wins, mostly passes over a corpus).

- New keys enter the small queue S (target: 10% of the tracked size); a key evicted from S
  that was not read while there leaves a ghost entry in G; a key read while in S moves to the
  main queue M instead.
- A key inserted while its ghost is in G goes straight to M.
- M is a FIFO with reinsertion: a key at its head with ``freq > 0`` goes back with
  ``freq - 1`` (freq counts reads, capped at 3); one with ``freq == 0`` is evicted.
- G remembers as many keys as M can hold (90% of the tracked keys).
- **Subtree first in S** (prefix-aware; not in the paper). Keys are chained hashes of the
  whole prefix, so a chunk whose parent is gone cannot be hit until the parent is written
  again: evicting a parent before its children left them as dead bytes (measured: 6.9% of the
  cache on passes over a corpus at 50%, two thirds of the evictions orphaning a child). When
  S picks an unread key (a one-hit wonder) that still has tracked, unpinned children
  (``parent`` on ``insert``), it keeps S's head and a leaf of its subtree goes instead, until
  the subtree is gone and the key itself goes: a one-shot prompt or a finished turn leaves
  whole, never as an orphaned tail. If a leaf found under it was read or sits in M, the key is
  no one-hit wonder (every read of a descendant read its prefix too) and moves to M as if
  read. If it is read before its subtree is gone, the head's rules keep it. Which keys may go
  is still S3-FIFO's choice, and so is scan resistance (unread keys never leave S for M). A
  leaf is found by walking down from the picked key; the walk is cached, so a subtree of n
  keys costs O(n) in all. M evicts its head as before, children or not: a child left behind
  in M comes back to life when its prefix is written again, which passes over a corpus do.
  (Measured and dropped: subtree first in M too, which won alone but, under ``dueling``,
  destabilised a main queue built while following ``adaptive``: 0.26 -> 0.13 byte hit ratio
  on shuffled passes at 50%; and leaving a key with children out of the queues until it is a
  leaf again: finished conversations then drained one chunk per pass, -18 points on
  round-robin chat at 25%.)

The policy never sees the tier's capacity: ``evict`` is only called when the tier is full, so
the tracked size stands in for it. Pinned keys are taken out of their queue (so ``evict`` never
walks over them) and go back to its tail when unpinned; a pinned child does not protect its
parent. A re-insert of a tracked key is an access (a new ``parent`` is ignored). Parent links
that form a cycle (impossible with chained hashes) are cut at the picked key. Thread-safety and
purity as in :mod:`kvtier.policies.base`.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.policies.base import NothingToEvict

SMALL_FRACTION = 0.1
MAX_FREQ = 3
_SMALL, _MAIN = 0, 1


class _Entry:
    """One tracked key: its size, reads (``freq``, capped), queue and parent."""

    __slots__ = ("freq", "parent", "queue", "size")

    def __init__(self, size: int, queue: int, parent: bytes) -> None:
        self.size = size
        self.freq = 0
        self.queue = queue
        self.parent = parent


class S3FIFOPolicy:
    """S3-FIFO whose victims go subtree first (see the module docstring).

    Not built on :class:`kvtier.policies.tree.LeafTree`: that keeps child *counts* and only
    leaves in its queues, while here every key keeps its FIFO place and a leaf must be found
    under a given key, so children are indexed by key.
    """

    name = "s3fifo"

    def __init__(self) -> None:
        self._nodes: dict[bytes, _Entry] = {}
        # parent key -> its tracked, unpinned children (the entry outlives the parent's
        # remove or eviction, so its re-insert finds them again)
        self._kids: dict[bytes, dict[bytes, None]] = {}
        self._small: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._pinned: set[bytes] = set()
        self._path: list[bytes] = []  # the last walk down from a picked key (see ``_leaf_under``)
        self._small_size = 0  # bytes of S, pinned members included
        self._total_size = 0

    def _queue(self, e: _Entry) -> OrderedDict[bytes, None]:
        return self._small if e.queue == _SMALL else self._main

    # --- the child index ---------------------------------------------------------------------
    def _attach(self, key: bytes, e: _Entry) -> None:
        if e.parent:
            kids = self._kids.get(e.parent)
            if kids is None:
                kids = self._kids[e.parent] = {}
            kids[key] = None

    def _detach(self, key: bytes, e: _Entry) -> None:
        kids = self._kids.get(e.parent) if e.parent else None
        if kids is not None:
            kids.pop(key, None)
            if not kids:
                del self._kids[e.parent]

    # --- the contract ------------------------------------------------------------------------
    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        size = max(0, int(size))
        e = self._nodes.get(key)
        if e is not None:
            self._resize(e, size)
            self.access(key)
            return
        parent = parent if parent != key else b""
        if key in self._ghost:
            del self._ghost[key]
            e = _Entry(size, _MAIN, parent)
        else:
            e = _Entry(size, _SMALL, parent)
            self._small_size += size
        self._nodes[key] = e
        self._total_size += size
        if key not in self._pinned:
            self._queue(e)[key] = None
            self._attach(key, e)

    def _resize(self, e: _Entry, size: int) -> None:
        self._total_size += size - e.size
        if e.queue == _SMALL:
            self._small_size += size - e.size
        e.size = size

    def access(self, key: bytes) -> None:
        e = self._nodes.get(key)
        if e is not None and e.freq < MAX_FREQ:
            e.freq += 1

    def remove(self, key: bytes) -> None:
        e = self._nodes.pop(key, None)
        if e is not None:
            self._drop(key, e)

    def forget_evicted(self, key: bytes) -> None:
        """Another policy tracking the same keys evicted ``key`` (kvtier.policies.dueling):
        stop tracking it as this one would have evicted it (a key evicted from S unread
        leaves a ghost). Unknown keys are ignored."""
        e = self._nodes.pop(key, None)
        if e is not None:
            self._haunt(key, e)
            self._drop(key, e)

    def _haunt(self, key: bytes, e: _Entry) -> None:
        """``key`` is being evicted: it leaves a ghost if it leaves S unread."""
        if e.queue == _SMALL and e.freq == 0:
            self._ghost[key] = None
            self._trim_ghost()

    def _drop(self, key: bytes, e: _Entry) -> None:
        """``key`` (already out of ``_nodes``) stopped being tracked: its queue entry, the
        sizes, and its place among its parent's children."""
        self._queue(e).pop(key, None)  # absent when pinned or popped at the head
        self._total_size -= e.size
        if e.queue == _SMALL:
            self._small_size -= e.size
        if key not in self._pinned:
            self._detach(key, e)

    def evict(self) -> bytes:
        small, main, nodes = self._small, self._main, self._nodes
        # Each pass evicts, spends one read of credit (a move S -> M, or a freq - 1
        # reinsertion in M), or moves a key with a read or M descendant S -> M (once per
        # insert), so the loop ends and costs O(1) amortised per operation.
        while small or main:
            if small and (self._small_size >= SMALL_FRACTION * self._total_size or not main):
                q = small
                key, _ = small.popitem(last=False)
                e = nodes[key]
                if e.freq > 0:
                    e.freq = 0
                    e.queue = _MAIN
                    self._small_size -= e.size
                    main[key] = None
                    continue
            else:
                q = main
                key, _ = main.popitem(last=False)
                e = nodes[key]
                if e.freq > 0:
                    e.freq -= 1
                    main[key] = None
                    continue
            if q is small and self._kids.get(key):  # subtree first: ``key`` keeps S's head
                leaf = self._leaf_under(key)
                if leaf != key:
                    below = nodes[leaf]
                    if below.freq > 0 or below.queue == _MAIN:
                        # A descendant was read or sits in M: no one-hit wonder (see above).
                        e.queue = _MAIN
                        self._small_size -= e.size
                        main[key] = None
                        continue
                    q[key] = None
                    q.move_to_end(key, last=False)
                    key, e = leaf, nodes[leaf]
            self._haunt(key, e)
            del nodes[key]
            self._drop(key, e)
            return key
        raise NothingToEvict("every tracked key is pinned")

    def _leaf_under(self, top: bytes) -> bytes:
        """A tracked, unpinned key under ``top`` with no such child (``top`` itself if the
        walk finds a cycle). The walk is kept in ``_path`` and resumed from its deepest key
        still linked to ``top``: evicting a subtree leaf by leaf walks each link about once."""
        path, kids = self._path, self._kids
        if not path or path[0] != top:
            path[:] = [top]
        else:  # keep the walk up to its first link that no longer holds (any key on it may
            # have been removed since; resuming below a broken link would leave the subtree)
            linked = 1
            while linked < len(path) and path[linked] in kids.get(path[linked - 1], ()):
                linked += 1
            del path[linked:]
        key = path[-1]
        limit = len(self._nodes)
        while True:
            below = kids.get(key)
            if not below:
                break
            if len(path) > limit:  # parent links form a cycle: cut it at ``top``
                path.clear()
                return top
            key = next(iter(below))
            path.append(key)
        path.pop()
        return key

    def _trim_ghost(self) -> None:
        limit = max(1, int((1 - SMALL_FRACTION) * len(self._nodes)))
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def pin(self, key: bytes) -> None:
        if key in self._pinned:
            return
        self._pinned.add(key)
        e = self._nodes.get(key)
        if e is not None:
            del self._queue(e)[key]
            self._detach(key, e)

    def unpin(self, key: bytes) -> None:
        if key not in self._pinned:
            return
        self._pinned.discard(key)
        e = self._nodes.get(key)
        if e is not None:
            self._queue(e)[key] = None
            self._attach(key, e)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

"""Pinning on a prefix tree, shared by the leaf-first policies (``prefix``, ``lfu``, ``adaptive``).

A leaf-first policy keeps a node per tracked key (its parent and a heap sequence number) and
only ever evicts leaves. A pinned key leaves the candidate heap (``seq = -1``, its parent no
longer counts it as a child, so the parent may become a leaf); unpinning puts it back. The
child counts (``_child_gone``, ``_child_added``) live here too; the subclass supplies ``_push``
(how a leaf enters its candidate heap).
"""

from __future__ import annotations

from typing import Any, Protocol


class TreeNode(Protocol):
    parent: bytes
    seq: int


class LeafTree:
    """Pins, child counts, membership and size over ``_nodes`` (key -> node), ``_kids``
    (key -> unpinned child count) and ``_pinned``; the owning policy defines ``_push``."""

    _nodes: dict[bytes, Any]
    _kids: dict[bytes, int]
    _pinned: set[bytes]

    def _child_gone(self, parent: bytes) -> None:
        """One unpinned child of ``parent`` stopped counting; the parent may become a leaf."""
        left = self._kids[parent] - 1
        if left:
            self._kids[parent] = left
            return
        del self._kids[parent]
        pn = self._nodes.get(parent)
        if pn is not None and parent not in self._pinned:
            self._push(parent, pn)

    def _child_added(self, parent: bytes) -> None:
        self._kids[parent] = self._kids.get(parent, 0) + 1
        pn = self._nodes.get(parent)
        if pn is not None:
            pn.seq = -1  # no longer a leaf

    def _push(self, key: bytes, node: Any) -> None:
        raise NotImplementedError

    def _enter(self, key: bytes, node: TreeNode) -> None:
        """An unpinned node joins the tree: its parent counts it as a child, and it is an
        eviction candidate while it has no children of its own."""
        if node.parent:
            self._child_added(node.parent)
        if not self._kids.get(key):
            self._push(key, node)

    def pin(self, key: bytes) -> None:
        if key in self._pinned:
            return
        self._pinned.add(key)
        node: TreeNode | None = self._nodes.get(key)
        if node is not None:
            node.seq = -1
            if node.parent:
                self._child_gone(node.parent)

    def unpin(self, key: bytes) -> None:
        if key not in self._pinned:
            return
        self._pinned.discard(key)
        node: TreeNode | None = self._nodes.get(key)
        if node is not None:
            self._enter(key, node)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

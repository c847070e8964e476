"""Depth and parent of the chunks the server promotes into a tier, so the node's eviction
policies see the links the client's Put gave (``policy.insert(key, size, depth, parent)``):
prefix-aware policies evict leaves before the prefixes they extend only if they know them,
and a chunk inserted with no parent is a root.

Where a promoted chunk's link comes from:

- A disk hit promoted into RAM (``TenantStore.get`` / ``get_into``): the lineage record of the
  chunk's file (kvtier.tiers.disk.lineage), written by the put that stored it, kept through
  restarts and written by a sharer too. Sealed to the key, so never a wrong parent. Read by
  path after the read that found the chunk: one getxattr, a few us beside that read. No
  record (a first chunk, a file system without user xattrs, a file evicted meanwhile, one a
  version before records wrote) or a bad one: promoted as a root, as before.
- A chunk read back from the lower tier (kvtier.server.lower): Redis keeps no links, so only
  this node's own Puts know them; ``LoweredStore`` remembers those (``writebehind.Lineage``,
  bounded). A chunk another node put, or one whose link this node has forgotten, is promoted
  as a root: nothing on this node knows its parent. The request does not tell it either: a
  Get's or Lookup's keys carry no depth and need not be consecutive chunks of one prefix.
"""

from __future__ import annotations

from collections.abc import MutableSequence, Sequence
from typing import Any

from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.disk import DiskTier, lineage
from kvtier.tiers.disk.layout import chunk_path

__all__ = ["disk_link", "from_disk"]


def disk_link(disk: DiskTier, key: bytes) -> tuple[int, bytes]:
    """``(depth, parent)`` that the put of ``key``'s chunk gave, from its file's lineage
    record; ``(0, b"")`` when none is known. Never raises."""
    path = chunk_path(disk.root, key)  # evicted since the read: no record, a root
    return lineage.parse(lineage.fetch(path), key, path)


def from_disk(disk: DiskTier, keys: Sequence[bytes], missing: Sequence[int], found: Sequence[Any],
              first: MutableSequence[Any], outs: Sequence[memoryview] | None = None) -> list[Entry]:
    """Set ``first[i]`` to the disk's answer ``found`` for ``keys[i]``, ``i`` in ``missing``,
    and return its hits as entries for RAM, each with the depth and parent its put gave
    (:func:`disk_link`). ``outs``: the buffers a ``get_into`` read into (``found`` holds
    lengths); None: ``found`` holds the chunks."""
    promote: list[Entry] = []
    for i, value in zip(missing, found):
        first[i] = value
        if not isinstance(value, Miss):
            data = value if outs is None else outs[i][:value]
            promote.append(Entry(keys[i], data, *disk_link(disk, keys[i])))
    return promote

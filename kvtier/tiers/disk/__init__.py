"""The local-SSD tier: one self-describing file per chunk, O_DIRECT where the platform has it.

- ``tier``: :class:`DiskTier`, the read and write paths (the tier contract's verbs).
- ``index``: the in-memory index, byte accounting and eviction (DiskTier's base class).
- ``layout``: file names, the start-up scan that rebuilds the index from chunk headers, and
  the atomic publish of a finished file.
- ``lineage``: each chunk file's depth and parent key, kept in an extended attribute, so a
  restart or a sharer's adoption tells the eviction policy what the put told it.
- ``direct_io``: O_DIRECT opens, aligned buffers and the low-level read/write checks.
"""

from kvtier.tiers.disk.direct_io import ALIGN, align_up
from kvtier.tiers.disk.layout import RebuildStats
from kvtier.tiers.disk.tier import DiskTier

__all__ = ["ALIGN", "DiskTier", "RebuildStats", "align_up"]

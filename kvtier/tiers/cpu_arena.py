"""The memory behind a :class:`~kvtier.tiers.cpu.CpuTier`'s arena: which kind of mapping a tier
gets (pre-touched and maybe CUDA-pinned; lazy private memory, with or without huge pages; or
a sealed memfd another process can map read-only) and the fallbacks where the host refuses
one.

Lazy arena (``CpuTier(..., lazy=True)``, kvtier-server)
For an owner that shares one RAM budget among several tiers: the arena (pageable,
``pin_memory="never"``) is *not* pre-touched (a slot's pages are faulted in by the first
put into it), and whenever a slot goes back on the free list its whole pages are returned
to the OS (``madvise(MADV_DONTNEED)``: the arena is a private anonymous mapping, whose
fresh pages fault in at about 0.65 ms/MiB here against 1.0 for a shared (shmem) one;
a slot still being read is retired and keeps its pages until
its last reader leaves; ``shed(reuse=True)`` keeps one shed's worth for the put that
follows). So resident memory follows the chunks held (page-rounded), not
the capacity, and :meth:`~kvtier.tiers.cpu.CpuTier.shed` lets the owner shrink a tier below its capacity. The cost is
a page fault per page on a put into a fresh slot. With ``huge_pages`` and slots of whole
2 MiB multiples (the server's default 4 MiB) the arena starts on a huge-page boundary and
asks for transparent huge pages (``MADV_HUGEPAGE``): a fault then brings in 2 MiB at once,
and a freed slot frees whole huge pages; resident memory is rounded to 2 MiB per chunk
(why it is not the default: small chunks in large slots would each keep 2 MiB resident).
``shareable`` (not with huge pages) backs the arena with a sealed memfd instead, freed by
``MADV_REMOVE``, so that kvtier-server can hand its clients a read-only mapping of it
(``reader_fd``; GET replies then name slots the client copies from: kvtier.server.arena_refs).
Never pinned (pin_memory="never"). The library's default (``lazy=False``) keeps the
pre-touched arena.
"""

from __future__ import annotations

import logging

from kvtier.config import CpuTierConfig
from kvtier.pinned import HUGE_PAGE, HostRegion

log = logging.getLogger("kvtier.tiers.cpu")


def allocate_arena(nbytes: int, config: CpuTierConfig, slot_bytes: int, lazy: bool, shareable: bool,
                    name: str) -> tuple[HostRegion, bool]:
    """(owner, shared): an anonymous mapping of exactly ``nbytes`` (page-aligned, so slots of
    page-multiple size can feed O_DIRECT writes without a bounce copy), registered with CUDA
    in slot-aligned pieces when CUDA is present (``kvtier.pinned``); a lazy one private, or
    with ``shareable`` a sealed memfd's (``shared``; not with huge pages, and a private one
    where no memfd can be made). Not torch's pinned allocator: it rounds up to a power of two
    (48 GiB would lock 64)."""
    if shareable and (not lazy or config.huge_pages):
        log.info("cpu tier %s: arena not shareable (%s)", name,
                 "huge pages are private memory" if lazy else "only a lazy arena is")
    shared = shareable and lazy and not config.huge_pages
    # Huge pages only where every slot is whole huge pages: freeing a slot then frees whole
    # huge pages, and a smaller slot never keeps a 2 MiB page resident for a few KiB.
    huge = config.huge_pages and slot_bytes % HUGE_PAGE == 0
    if config.huge_pages and lazy and not huge:
        log.warning("cpu tier %s: huge_pages ignored: slot_bytes %d is not a multiple of 2 MiB "
                    "(%d would be)", name, slot_bytes, -(-slot_bytes // HUGE_PAGE) * HUGE_PAGE)
    try:
        region = HostRegion(nbytes, config.pin_memory, align=slot_bytes, private=lazy and not shared,
                            huge_pages=huge, memfd=shared)
    except OSError as exc:  # no memfd here (a seccomp filter, say): a private arena instead
        if not shared:
            raise
        log.warning("cpu tier %s: no shareable arena (%s); a private one instead", name, exc)
        shared = False
        region = HostRegion(nbytes, config.pin_memory, align=slot_bytes, private=lazy, huge_pages=huge)
    if not region.pinned and config.pin_memory != "never":
        log.debug("cpu tier: arena of %d bytes is pageable memory", nbytes)
    return region, shared

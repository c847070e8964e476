"""The memory behind a :class:`~kvtier.tiers.cpu.CpuTier`'s arena: which kind of mapping a tier
gets (pre-touched and maybe CUDA-pinned; lazy private memory, with or without huge pages; or
a sealed memfd another process can map read-only) and the fallbacks where the host refuses
one. The tier's module docstring says what each kind is for."""

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

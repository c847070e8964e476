"""GET replies that name RAM slots instead of copying them: one copy per chunk on the same host.

Why: on the shared-memory path a GET's RAM hit was copied twice, by the server from its arena
into the connection's segment, then by the client from the segment into its own buffer (the
SGLang backend's host pool, a vLLM block). Two passes over every byte through DRAM, on the
same cores: a server read reached 0.6 of what the client's own RAM tier gives (SGLang HiCache
pages of 4 MiB, bench/e2e_sglang.py). Here the client maps its tenant's arena read-only (the
arena is a sealed memfd, ``CpuTier(shareable=True)``; its read-only descriptor travels with
the segment's, kvtier.server.shm) and the reply carries ``offset ‖ length`` into it: the
client's copy is the only one.

Holds: each slot a reply names is held (``CpuTier.hold``: never reused, whatever happens to
its key: an overwrite, an eviction or a delete takes another slot or waits) until the
connection's next request arrives, when :meth:`ArenaRefs.release` gives them back; so the
client reads a chunk that cannot change under it for as long as it has not sent another
request (the contract of segment references too). At most ``max_bytes`` (the segment's size)
are held per connection; hits beyond it take the segment as before. A connection that dies or
idles out releases its holds with its thread.

Trust: the descriptor is opened ``O_RDONLY``, so the client can neither write the arena nor
change its size (both sealed); it sees its own tenant's arena only, which holds that tenant's
chunks and, in free slots, that tenant's old bytes or zeros: nothing another tenant wrote. It
can read any chunk of its tenant, which its token lets it GET anyway.

Threads: one :class:`ArenaRefs` per connection, used by that connection's thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtier.server.storage import TenantStore
from kvtier.tiers.base import Miss

log = logging.getLogger(__name__)


def reader_fd(store: TenantStore) -> tuple[int, int]:
    """(a new read-only descriptor of the tenant's arena, its size), or (-1, 0) where the
    tenant has no shareable arena (no RAM tier, huge pages, arena reads off) or no descriptor
    can be made (logged)."""
    ram = store.ram
    if ram is None or not ram.shared:
        return -1, 0
    try:
        return ram.reader_fd(), ram.arena_bytes  # spare slots included: a chunk may lie in one
    except OSError as exc:
        log.warning("data path: the arena cannot be shared (%s); GETs copy into the segment", exc)
        return -1, 0


class ArenaRefs:
    """The slots one connection's last GET reply named."""

    def __init__(self, store: TenantStore, max_bytes: int) -> None:
        assert store.ram is not None and store.ram.shared
        self.ram = store.ram
        self.traffic = store.traffic
        self.max_bytes = max_bytes
        self.held: list[int] = []
        self.held_bytes = 0

    def hold(self, keys: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """Per key ``(offset, length)`` of its chunk in the arena, held until :meth:`release`,
        counted as a RAM hit; None for a key RAM does not hold, or past ``max_bytes`` (the
        caller serves those as before)."""
        out: list[tuple[int, int] | None] = []
        over: list[int] = []
        hits = hit_bytes = 0
        for found in self.ram.hold(keys):
            if isinstance(found, Miss):
                out.append(None)
                continue
            slot, offset, length = found
            if self.held_bytes + length > self.max_bytes:
                over.append(slot)
                out.append(None)
                continue
            self.held.append(slot)
            self.held_bytes += length
            hits, hit_bytes = hits + 1, hit_bytes + length
            out.append((offset, length))
        if over:
            self.ram.release(over)
        if hits:
            self.traffic.count_hits(self.ram.name, hits, hit_bytes)
        return out

    def release(self) -> None:
        """Give back every held slot (the client sent its next request, or is gone)."""
        if self.held:
            self.ram.release(self.held)
            self.held = []
            self.held_bytes = 0

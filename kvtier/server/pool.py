"""Tenant quotas as caps on one shared budget per medium (kvtier-server's RAM and disk).

Why: with a fixed split (each of n tenants gets ``min(quota, capacity // n)``) one busy
tenant cannot use the capacity the others leave idle. Here each tenant's tier is sized to its
*cap* (its quota, or the whole budget when it has none) and a :class:`SharedPool` bounds the
sum: before a put, when the tenants together would pass ``capacity_bytes``, chunks are evicted
first from the putting tenant if it is above its guaranteed share, else from the tenant most
above its own share. The guaranteed share is ``min(cap, capacity // n)``: the shares sum to
at most the budget, so a tenant within its share is never evicted for another's sake — a
quiet tenant's chunks survive any flood up to that share. Eviction inside one tenant follows
its own tier's policy (LRU by default); a tenant at its cap evicts its own chunks first (its
tier does that by itself).

The pool only needs a tier's ``used_bytes`` and ``shed()`` (:class:`SheddingTier`), so one pool
class serves both media: the disk tier sheds chunk files, the RAM tier (a lazily backed
:class:`~kvtier.tiers.cpu.CpuTier` arena) sheds slots and returns their pages to the OS, so
the server's resident memory follows the bytes the pool admits rather than the sum of caps.

Bound: the check and the write are not one atomic step, so concurrent puts may pass the
budget by at most the chunks in flight (bounded by connections x max_chunk_bytes, times
kvtier.server.put_run.RUN_SLOTS on the data path, whose PUT runs receive up to that many
chunks before any is counted) until the next put evicts again. The pool counts chunk bytes
(``used_bytes``); a RAM chunk's pages round it up to the page size.

Threads: :meth:`SharedPool.make_room` may be called from any thread (one lock serialises
decisions; a tier's own lock is only ever taken inside the pool's, never the other way).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Protocol


class SheddingTier(Protocol):
    """A tier whose owner can shrink it: ``shed(n)`` evicts (the tier's own policy order)
    until at least ``n`` chunk bytes are freed or nothing evictable is left, and returns the
    bytes freed; ``reuse=True`` says a put into that same tier follows (a RAM arena then keeps
    the freed pages for it). Thread-safe."""

    @property
    def used_bytes(self) -> int: ...

    def shed(self, nbytes: int, reuse: bool = False) -> int: ...


class SharedPool:
    def __init__(self, capacity_bytes: int, tiers: Mapping[str, SheddingTier], shares: Mapping[str, int]) -> None:
        if set(tiers) != set(shares):
            raise ValueError(f"pool tiers {sorted(tiers)} and shares {sorted(shares)} name different tenants")
        self.capacity_bytes = capacity_bytes
        self.tiers = dict(tiers)
        self.shares = dict(shares)
        self._lock = threading.Lock()
        self.evicted_bytes = 0  # freed by the pool for another tenant (or for the putter itself)

    def used(self) -> int:
        return sum(t.used_bytes for t in self.tiers.values())

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit in the budget without evicting anything."""
        return nbytes <= self.room()

    def room(self) -> int:
        """Bytes that fit in the budget without evicting anything (negative when it is over)."""
        with self._lock:
            return self.capacity_bytes - self.used()

    def make_room(self, tenant: str, nbytes: int) -> None:
        """Evict until ``nbytes`` more fit in the budget, or no tenant above its share is left."""
        with self._lock:
            usage = {name: t.used_bytes for name, t in self.tiers.items()}
            over = sum(usage.values()) + nbytes - self.capacity_bytes
            while over > 0:
                victim = self._victim(tenant, usage, nbytes)
                if victim is None:
                    return  # everyone within their share: the put may pass the budget by nbytes
                excess = usage[victim] - self.shares[victim] + (nbytes if victim == tenant else 0)
                # The putter's own slots are refilled at once: no need to hand pages back.
                freed = self.tiers[victim].shed(min(over, excess), reuse=victim == tenant)
                if not freed:
                    return
                usage[victim] -= freed
                over -= freed
                self.evicted_bytes += freed

    def _victim(self, tenant: str, usage: Mapping[str, int], nbytes: int) -> str | None:
        if usage[tenant] + nbytes > self.shares[tenant] and usage[tenant] > 0:
            return tenant
        above = [(usage[n] - self.shares[n], n) for n in usage if n != tenant and usage[n] > self.shares[n]]
        return max(above)[1] if above else None

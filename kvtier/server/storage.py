"""The server's chunk storage: one tier stack per tenant (RAM over an optional disk).

Why one stack per tenant rather than one shared tier with tenant-prefixed keys: isolation is
then structural (a request only ever reaches its own tenant's tier objects, so knowing
another tenant's key gets nothing, not even a timing difference), a tenant's cap is just
the capacity of its tiers (eviction inside a tenant follows that tenant's own policy; the
shared pools below only choose *which* tenant sheds), and a restart rebuilds each tenant's index from its own directory
(``<disk.path>/tenants/<tenant>``) because chunk headers carry client keys, not storage keys.

Capacity: quotas are caps on one shared budget per medium (:mod:`kvtier.server.pool`), RAM
(``cpu.capacity_bytes``) and disk (``disk.capacity_bytes``) alike: a tenant may use up to its
quota (or the whole budget without one) while others leave room, and is guaranteed
``min(quota, capacity // n)`` of each, where quota is the tenant's own or
``default_quota_bytes`` (0 = none). Every put into a tier makes room in its pool first: a
Put's write, and on a disk-backed server also the RAM copy and every promotion of a disk hit
into RAM. With a disk tier the chunks are written through to disk (a Put is acknowledged
once it is on disk, so it survives ``kill -9``) and RAM caches them; without one RAM holds
everything. Each tenant's RAM arena is sized to its cap but lazily backed (pages are faulted
in by puts and returned to the OS when the pool or a delete frees a slot), so the server's
resident memory follows the RAM budget, not n x cap; the virtual reservation is n x cap.

Threads: every method may be called from any thread (the tiers serialise themselves); calls
block on file I/O, so the gRPC side runs them in its executor. No torch is ever imported:
the RAM tier is built with ``pin_memory="never"``.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from kvtier.config import CpuTierConfig, DiskTierConfig
from kvtier.server.auth import Tenant
from kvtier.server.chunk_links import from_disk
from kvtier.server.pool import SharedPool
from kvtier.server.tenant_budget import spare_slots, tier_cap, tier_share
from kvtier.server.traffic import TenantUsage, Traffic
from kvtier.server.warm_ahead import WarmAhead
from kvtier.tiers.base import Entry, Miss, Probe, Tier
from kvtier.tiers.cpu import CpuTier, Reservation
from kvtier.tiers.disk import DiskTier

if TYPE_CHECKING:
    from kvtier.server.events import EventSink

__all__ = ["Storage", "TenantStore", "TenantUsage", "Traffic"]

log = logging.getLogger(__name__)


class TenantStore:
    """One tenant's chunks. ``ram`` may be absent (cpu disabled), ``disk`` too (disk
    disabled), never both. The bottom tier bounds the tenant: it is the quota. ``ram_pool``
    and ``disk_pool`` are the shared budgets its tiers belong to (None: the tier is bounded
    only by its own capacity); Storage sets them once every tenant is built."""

    direct_puts: ClassVar[bool] = True  # put() is a RAM put alone: reserve() may bypass it

    def __init__(self, tenant: Tenant, ram: CpuTier | None, disk: DiskTier | None,
                 ram_pool: SharedPool | None = None, disk_pool: SharedPool | None = None) -> None:
        if ram is None and disk is None:
            raise ValueError("a tenant store needs a RAM tier, a disk tier or both")
        self.tenant = tenant
        self.ram = ram
        self.disk = disk
        self.tiers: tuple[Tier, ...] = tuple(t for t in (ram, disk) if t is not None)
        self.bottom = self.tiers[-1]
        self.max_chunk_bytes = disk.capacity_bytes if disk is not None else ram.slot_bytes  # type: ignore[union-attr]
        self.traffic = Traffic()
        self.ram_pool = ram_pool
        self.disk_pool = disk_pool
        self.events: EventSink | None = None  # KV events (kvtier.server.events.attach)

    @property
    def quota_bytes(self) -> int:
        return self.bottom.usage().capacity_bytes

    def probe(self, keys: Sequence[bytes]) -> Probe:
        """Leading keys present in any of the tenant's tiers (counted in ``traffic``)."""
        result, by_tier = self._probe(keys)
        self.traffic.lookup(by_tier, len(keys) - result.hits, result.reason)
        return result

    def _probe(self, keys: Sequence[bytes]) -> tuple[Probe, Counter[str]]:
        by_tier: Counter[str] = Counter()
        if len(self.tiers) == 1:
            p = self.tiers[0].probe(keys)
            by_tier[self.tiers[0].name] += p.hits
            return p, by_tier
        hits, reason = 0, "absent"
        while hits < len(keys):
            advanced = False
            for tier in self.tiers:
                p = tier.probe(keys[hits:])
                if p.hits:
                    hits += p.hits
                    by_tier[tier.name] += p.hits
                    advanced = True
                else:
                    reason = p.reason
                if hits == len(keys):
                    break
            if not advanced:
                return Probe(hits, reason), by_tier
        return Probe(hits), by_tier

    def holds(self, key: bytes) -> bool:
        """Whether a tier holds ``key`` now; unlike :meth:`probe`, not counted as a lookup."""
        if self.ram is not None and self.ram.holds(key):
            return True
        return self.disk is not None and self.disk.probe([key]).hits > 0

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        """Chunks (fresh bytes) or misses; a disk hit is promoted into RAM."""
        first = self.tiers[0].get(keys)
        top_hits = sum(not isinstance(v, Miss) for v in first)
        result = self._get_below(keys, first)
        self._count_get(top_hits, result, [len(v) for v in result if not isinstance(v, Miss)])
        return result

    def _count_get(self, top_hits: int, result: Sequence[object], sizes: Iterable[int]) -> None:
        misses = [v for v in result if isinstance(v, Miss)]
        hits = Counter({self.tiers[0].name: top_hits})
        if len(self.tiers) > 1:
            hits[self.tiers[1].name] = len(result) - len(misses) - top_hits
        self.traffic.get(+hits, misses, sum(sizes))

    def _get_below(self, keys: Sequence[bytes], first: list[bytes | Miss]) -> list[bytes | Miss]:
        if len(self.tiers) == 1 or self.disk is None:
            return first
        missing = [i for i, v in enumerate(first) if isinstance(v, Miss)]
        if not missing:
            return first
        found = self.disk.get([keys[i] for i in missing])
        self._cache(from_disk(self.disk, keys, missing, found, first))  # with their links
        return first

    @contextmanager
    def leased_ram(self, keys: Sequence[bytes]) -> Iterator[list[memoryview | None]]:
        """Zero-copy views of ``keys``' chunks in the RAM tier for the ``with`` block (see
        :meth:`CpuTier.leased_many`: the slots are not reused meanwhile), counted as RAM hits;
        None for a key RAM does not hold (the caller then takes :meth:`get_into`, which looks
        below and promotes)."""
        if self.ram is None:
            yield [None] * len(keys)
            return
        with self.ram.leased_many(keys) as views:
            found = [None if isinstance(v, Miss) else v for v in views]
            hits = [v.nbytes for v in found if v is not None]
            if hits:  # what _count_get counts for hits only, without its Counters
                self.traffic.count_hits(self.ram.name, len(hits), sum(hits))
            yield found

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        """Chunks copied into ``outs`` (no allocation); a disk hit is promoted into RAM.
        Raises ValueError when a chunk does not fit its buffer (as the tiers do)."""
        first = self.tiers[0].get_into(keys, outs)
        top_hits = sum(not isinstance(v, Miss) for v in first)
        result = self._get_into_below(keys, outs, first)
        self._count_get(top_hits, result, [v for v in result if not isinstance(v, Miss)])
        return result

    def _get_into_below(self, keys: Sequence[bytes], outs: Sequence[memoryview],
                        first: list[int | Miss]) -> list[int | Miss]:
        if self.disk is None or self.tiers[0] is self.disk:
            return first
        missing = [i for i, v in enumerate(first) if isinstance(v, Miss)]
        if not missing:
            return first
        found = self.disk.get_into([keys[i] for i in missing], [outs[i] for i in missing])
        self._cache(from_disk(self.disk, keys, missing, found, first, outs))  # with their links
        return first

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        """Stored when the bottom tier (the tenant's quota) took it; RAM is a cache."""
        if self.disk is None:
            assert self.ram is not None
            stored = self._put_ram(entries)
        else:
            self._announce(self.disk, entries)
            if self.disk_pool is not None:
                self.disk_pool.make_room(self.tenant.name, sum(_nbytes(e) for e in entries))
            stored = self.disk.put(entries)
            self._refused(self.disk, entries, stored)
            self._cache([e for e, ok in zip(entries, stored) if ok])
        self.traffic.put(sum(memoryview(e.data).nbytes for e, ok in zip(entries, stored) if ok),
                         stored.count(False))
        return stored

    def reserve(self, nbytes: int) -> Reservation | None:
        """A free RAM slot for a chunk of ``nbytes`` the caller writes in place (the data path
        receives a PUT body straight into it); then :meth:`commit` or :meth:`abort`. Never
        evicts (the chunk is not verified yet: a refused one must cost nothing). A tenant
        whose RAM tier is full gets one of its spare slots, and :meth:`commit` evicts one of
        its own chunks for it (kvtier.tiers.cpu, "Spare slots"). None when a put here is more
        than a RAM put (a disk tier below, a subclass with ``direct_puts`` off), when it
        would take an eviction this tenant's tier cannot make at commit (no free or spare
        slot; the RAM pool full while the tier is not) or the chunk does not fit a slot: the
        caller then verifies first and uses :meth:`put`."""
        ram = self._direct_ram(nbytes)
        if ram is None or (self.ram_pool is not None and not ram.full and not self.ram_pool.fits(nbytes)):
            return None
        return ram.reserve(nbytes)

    def reserve_many(self, nbytes: int, most: int) -> list[Reservation]:
        """Up to ``most`` reservations of ``nbytes`` each (see :meth:`reserve`), no more than
        fit together in the RAM pool's budget (one, a spare, where the tenant's tier is full):
        the data path's PUT runs hold several at once.
        The budget is read once for the run (a pass over every tenant's usage: with many
        tenants, once per slot cost more than the slot)."""
        ram = self._direct_ram(nbytes)
        if ram is None:
            return []
        if ram.full:  # spare slots, shared by the tenant's connections: one each at a time
            most = min(most, 1)
        elif self.ram_pool is not None:
            most = min(most, max(0, self.ram_pool.room()) // max(1, nbytes))
        out: list[Reservation] = []
        while len(out) < most:
            res = ram.reserve(nbytes)
            if res is None:
                break
            out.append(res)
        return out

    def _direct_ram(self, nbytes: int) -> CpuTier | None:
        """The RAM tier, where a chunk of ``nbytes`` may be received straight into one of its
        slots (see :meth:`reserve`)."""
        ram = self.ram
        if ram is None or self.disk is not None or not self.direct_puts or nbytes > ram.slot_bytes:
            return None
        return ram

    def commit(self, res: Reservation, entry: Entry) -> bool:
        """Publish a reserved chunk (already verified by the caller) as ``entry``; counted as
        a put."""
        assert self.ram is not None  # reserve() returned a reservation
        if self.events is not None:  # (a put per chunk: no lists built for events nobody takes)
            self._announce(self.ram, [entry])
        ok = self.ram.commit(res, entry.key, entry.depth, entry.parent)
        if not ok and self.events is not None:
            self._refused(self.ram, [entry], [ok])
        self.traffic.put(res.view.nbytes if ok else 0, 0 if ok else 1)
        return ok

    def abort(self, res: Reservation) -> None:
        assert self.ram is not None
        self.ram.abort(res)

    # KV events (kvtier.server.events): a put is announced before it runs, its refusals after
    # it, so an eviction the put causes is published after what it evicts (as kvtier.store).
    def _announce(self, tier: Tier, entries: Sequence[Entry]) -> None:
        if self.events is not None and entries:
            self.events.stored(tier.name, entries)

    def _refused(self, tier: Tier, entries: Sequence[Entry], ok: Sequence[bool]) -> None:
        if self.events is not None and not all(ok):
            self.events.removed(tier.name, [e.key for e, k in zip(entries, ok) if not k])

    def _cache(self, entries: Sequence[Entry]) -> None:
        """Copy chunks the disk holds into RAM (a cache: a refusal loses nothing)."""
        if entries and self.ram is not None:
            self._put_ram(entries)

    def _put_ram(self, entries: Sequence[Entry]) -> list[bool]:
        """Put into RAM after making room in the RAM pool for the chunks that fit a slot (a
        larger one is refused by the tier, so nothing is evicted for it)."""
        ram = self.ram
        assert ram is not None
        self._announce(ram, entries)
        if self.ram_pool is not None:
            fits = sum(n for n in map(_nbytes, entries) if n <= ram.slot_bytes)
            if fits:
                self.ram_pool.make_room(self.tenant.name, fits)
        stored = ram.put(entries)
        self._refused(ram, entries, stored)
        return stored

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: whether it was present in any tier."""
        existed = [False] * len(keys)
        for tier in self.tiers:
            gone = []
            for i, key in enumerate(keys):
                if tier.delete([key]):
                    existed[i] = True
                    gone.append(key)
            if self.events is not None and gone:
                self.events.removed(tier.name, gone)
        return existed

    def usage(self) -> TenantUsage:
        tiers = tuple(t.usage() for t in self.tiers)
        bottom = tiers[-1]
        # The bottom tier's evictions: chunks evicted to stay within the quota.
        return TenantUsage(self.tenant.name, bottom.used_bytes, bottom.capacity_bytes,
                           bottom.entries, bottom.evictions, tiers)

    def check(self) -> list[str]:
        return [f"{self.tenant.name}/{t.name}: {p}" for t in self.tiers for p in t.check()]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


class Storage:
    """Every tenant's store, built at start (so each disk index is rebuilt at start)."""

    def __init__(self, tenants: Iterable[Tenant], cpu: CpuTierConfig, disk: DiskTierConfig,
                 default_quota_bytes: int = 0,
                 store_factory: Callable[..., TenantStore] | None = None, shareable_ram: bool = False) -> None:
        # store_factory(tenant, ram, disk): kvtier.server.lower's stores over a lower tier.
        # shareable_ram: RAM arenas clients can map read-only (kvtier.server.arena_refs).
        make_store = store_factory or TenantStore
        tenants = list(tenants)
        if not cpu.enabled and not disk.enabled:
            raise ValueError("the server needs the cpu tier, the disk tier or both enabled")
        n = max(1, len(tenants))
        self.stores: dict[str, TenantStore] = {}
        self.warm_ahead: WarmAhead | None = None
        ram_shares: dict[str, int] = {}  # guaranteed bytes per tenant, of each budget
        disk_shares: dict[str, int] = {}
        try:
            for tenant in tenants:
                quota = tenant.quota_bytes or default_quota_bytes
                ram = disk_tier = None
                if cpu.enabled:
                    cap = tier_cap(cpu.capacity_bytes, quota)
                    ram_shares[tenant.name] = tier_share(cpu.capacity_bytes, n, quota)
                    if cap < cpu.slot_bytes:
                        log.warning("tenant %r: its RAM (%d bytes) is smaller than cpu.slot_bytes (%d): "
                                    "its slots shrink to %d bytes and larger chunks are refused",
                                    tenant.name, cap, cpu.slot_bytes, cap)
                    slot = min(cpu.slot_bytes, cap)
                    ram = CpuTier(dataclasses.replace(cpu, capacity_bytes=cap, slot_bytes=slot, pin_memory="never"),
                                  name="cpu", lazy=True, shareable=shareable_ram, spare_slots=spare_slots(cap // slot))
                if disk.enabled:
                    cap = tier_cap(disk.capacity_bytes, quota)
                    disk_shares[tenant.name] = tier_share(disk.capacity_bytes, n, quota)
                    path = Path(disk.path).expanduser() / "tenants" / tenant.name
                    disk_tier = DiskTier(dataclasses.replace(disk, path=str(path), capacity_bytes=cap),
                                         name="disk")
                    stats = disk_tier.rebuild_stats
                    log.info("tenant %s: disk index rebuilt: %d chunks, %d bytes, %d bad files removed",
                             tenant.name, stats.files, stats.bytes, stats.bad)
                self.stores[tenant.name] = make_store(tenant, ram, disk_tier)
            if disk.enabled:
                disk_pool = SharedPool(disk.capacity_bytes, {name: s.disk for name, s in self.stores.items()
                                                             if s.disk is not None}, disk_shares)
                for store in self.stores.values():
                    store.disk_pool = disk_pool
            if cpu.enabled:
                ram_pool = SharedPool(cpu.capacity_bytes, {name: s.ram for name, s in self.stores.items()
                                                           if s.ram is not None}, ram_shares)
                for store in self.stores.values():
                    store.ram_pool = ram_pool
                if cpu.warm_ahead_bytes:
                    self.warm_ahead = WarmAhead([s.ram for s in self.stores.values() if s.ram is not None],
                                                ram_pool, cpu.warm_ahead_bytes)
        except BaseException:
            self.close()
            raise

    def store(self, tenant: str) -> TenantStore:
        return self.stores[tenant]

    def max_chunk_bytes(self) -> int:
        return min(s.max_chunk_bytes for s in self.stores.values())

    def slot_bytes(self) -> int:
        """The RAM tier's slot size (its largest chunk), 0 without a RAM tier."""
        return max((s.ram.slot_bytes for s in self.stores.values() if s.ram is not None), default=0)

    def check(self) -> list[str]:
        return [p for s in self.stores.values() for p in s.check()]

    def close(self) -> None:
        if self.warm_ahead is not None:
            self.warm_ahead.close()
        for store in self.stores.values():
            store.close()


def _nbytes(entry: Entry) -> int:
    return memoryview(entry.data).nbytes

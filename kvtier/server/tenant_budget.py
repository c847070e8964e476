"""How a kvtier-server splits each budget (``cpu.capacity_bytes``, ``disk.capacity_bytes``)
among its tenants: each tenant's tier capacity (its quota within the budget), its guaranteed
share (what the shared pool never evicts for another tenant's sake: kvtier.server.pool), and
the spare RAM slots its puts may hold beyond its capacity while the tier is full."""

from __future__ import annotations

from kvtier.server.auth import MIN_QUOTA_BYTES

MIN_TIER_BYTES = MIN_QUOTA_BYTES  # CpuTierConfig/DiskTierConfig lower bound; no quota is smaller
SPARE_SLOTS = 8  # most spare RAM slots per tenant (see spare_slots)


def spare_slots(slots: int) -> int:
    """Spare slots for a tenant's RAM tier of ``slots`` (kvtier.tiers.cpu, "Spare slots"):
    one per connection putting into it once it is full (a connection holds one at a time),
    for up to eight at once, and at most 1/16 of its capacity above the budget (none below
    16 slots)."""
    return min(SPARE_SLOTS, slots // 16)


def tier_cap(capacity: int, quota: int) -> int:
    """A tenant's tier capacity: its quota within the budget, or the whole budget."""
    return max(MIN_TIER_BYTES, min(quota, capacity) if quota else capacity)


def tier_share(capacity: int, tenants: int, quota: int) -> int:
    """A tenant's guaranteed part of a budget: ``min(quota, capacity // tenants)``. Never
    raised to a floor (a tier's capacity has one, MIN_TIER_BYTES; a share does not): the
    shares must sum to at most the budget, or the pool lets the tenants together pass it
    (with 1 MiB floors, 64 tenants on a 16 MiB budget were each guaranteed 1 MiB)."""
    share = capacity // tenants
    return min(quota, share) if quota else share

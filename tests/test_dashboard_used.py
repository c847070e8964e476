"""The cluster dashboard's used / capacity per tier (kvtier.server.dashboard.node_summary):
counted as the capacity it is divided by counts, so it never passes 1 on a healthy node.
The same figure through a real Prometheus and server: tests/test_prometheus_formulas.py."""

from __future__ import annotations

from typing import Any

from kvtier.server.dashboard import cluster_document, node_summary


def _doc(budget: int, quotas: tuple[int, int]) -> dict[str, Any]:
    """Two tenants, 10 chunks of 100 KiB each in 1 MiB RAM slots."""
    return {"node_id": "n", "capacity_bytes": {"cpu": budget}, "tenants": [
        {"tenant": name, "used_bytes": 10 << 20, "quota_bytes": quota, "entries": 10, "evictions": 0,
         "tiers": [{"name": "cpu", "used_bytes": 10 << 20, "chunk_bytes": 10 * (100 << 10),
                    "capacity_bytes": quota, "entries": 10}]}
        for name, quota in zip(("a", "b"), quotas)]}


def test_a_shared_budget_is_compared_with_the_chunk_bytes_it_counts() -> None:
    """No quotas: each tenant may fill the 16 MiB budget, which counts chunk bytes. The 20
    slots held (20 MiB) over the budget read 125 %."""
    [cpu] = node_summary(_doc(16 << 20, (16 << 20, 16 << 20)))["tiers"]
    assert (cpu["used_bytes"], cpu["chunk_bytes"], cpu["capacity_bytes"]) == (20 * (100 << 10),) * 2 + (16 << 20,)
    totals = cluster_document(_doc(16 << 20, (16 << 20, 16 << 20)), [], now=0.0)["totals"]
    assert totals["used_bytes"] / totals["capacity_bytes"] == 20 * (100 << 10) / (16 << 20)


def test_quotas_within_the_budget_are_compared_with_the_slots_that_bound_them() -> None:
    """Quotas of 10 MiB each in a 32 MiB budget: each tenant's own tier (10 slots) bounds it,
    and both are full: 100 %, not the chunk bytes' 10 %."""
    [cpu] = node_summary(_doc(32 << 20, (10 << 20, 10 << 20)))["tiers"]
    assert (cpu["used_bytes"], cpu["capacity_bytes"]) == (20 << 20, 20 << 20)

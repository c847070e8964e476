"""FairGate (kvtier.server.fair_gate): each tenant's turns for gRPC Get replies, on a real
event loop: the per-tenant limit, one tenant's held turns never blocking another's, and the
bookkeeping after cancelled waiters."""

from __future__ import annotations

import asyncio

import pytest

from kvtier.server.fair_gate import FairGate


def test_each_tenant_holds_at_most_its_turns() -> None:
    async def run() -> dict[str, int]:
        gate, held, peak = FairGate(3), {"a": 0, "b": 0}, {"a": 0, "b": 0}

        async def one(tenant: str) -> None:
            async with gate.turn(tenant):
                held[tenant] += 1
                peak[tenant] = max(peak[tenant], held[tenant])
                await asyncio.sleep(0.001)
                held[tenant] -= 1
        await asyncio.gather(*(one("ab"[i % 2]) for i in range(40)))
        assert gate.in_use() == {}
        return peak
    assert asyncio.run(run()) == {"a": 3, "b": 3}


def test_a_tenant_whose_turns_are_stuck_blocks_only_itself() -> None:
    """Tenant a's turns are all held by calls that never finish (a client that stopped
    reading); tenant b still gets a turn at once, a's next call waits."""
    async def run() -> None:
        gate, stuck = FairGate(2), asyncio.Event()

        async def hold(tenant: str) -> None:
            async with gate.turn(tenant):
                await stuck.wait()
        holders = [asyncio.create_task(hold("a")) for _ in range(2)]
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold("a"))
        await asyncio.sleep(0)
        async with asyncio.timeout(1):
            async with gate.turn("b"):
                pass
        assert not waiter.done() and gate.in_use() == {"a": 3}
        stuck.set()
        await asyncio.gather(*holders, waiter)
        assert gate.in_use() == {}
    asyncio.run(run())


def test_cancelled_waiters_leave_the_counts_right() -> None:
    """A waiter cancelled while it waits and a holder cancelled while it holds: the tenant's
    turns all come back and its state is dropped."""
    async def run() -> None:
        gate, never = FairGate(1), asyncio.Event()

        async def hold() -> None:
            async with gate.turn("a"):
                await never.wait()
        holder = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter = asyncio.create_task(hold())
        await asyncio.sleep(0)
        waiter.cancel()
        holder.cancel()
        for task in (waiter, holder):
            with pytest.raises(asyncio.CancelledError):
                await task
        assert gate.in_use() == {}
        async with asyncio.timeout(1):
            async with gate.turn("a"):
                pass
    asyncio.run(run())


def test_per_tenant_must_be_positive() -> None:
    with pytest.raises(ValueError, match="per_tenant must be >= 1"):
        FairGate(0)

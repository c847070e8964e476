"""Each tenant's turns for the bulk gRPC messages it has the node send (Get replies).

Why: one event loop carries every tenant's gRPC calls, and each reply message costs it a
multi-MiB write. Unbounded, one tenant's sixteen Get streams kept sixteen 4 MiB writes queued
ahead of every other call, and another tenant's 2 ms Lookup took ~0.5 s
(bench/tenant_flood.py). Here each tenant has at most ``per_tenant`` batches in flight (being
fetched, encoded and handed to grpc); its other streams wait for one of its own turns, so the
loop's queue holds at most ``per_tenant`` batches of each busy tenant, however many streams it
opens. Small calls (Lookup, Delete, Info, Stats) never take a turn; Put requests do not either
(the servicer says why).

The turns are per tenant, not one shared pool handed round: a Get turn is held until grpc
has taken the message, and a client that stops reading holds it (for ``grpc_send_stall_s``,
then its call goes on without it: kvtier.server.servicer). Shared turns would let one
tenant's unread streams stall everyone's bulk calls; here they stall only that tenant's own.

Threads: the event loop's only (no locks); a waiter cancelled while it waits or holds a turn
leaves the counts right (asyncio.Semaphore's own rules).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class FairGate:
    def __init__(self, per_tenant: int) -> None:
        if per_tenant < 1:
            raise ValueError(f"FairGate per_tenant must be >= 1, got {per_tenant}")
        self.per_tenant = per_tenant
        self._turns: dict[str, asyncio.Semaphore] = {}
        self._users: Counter[str] = Counter()  # callers holding or waiting, per tenant

    @asynccontextmanager
    async def turn(self, tenant: str) -> AsyncIterator[None]:
        """Hold one of ``tenant``'s turns for the body (waiting for one if all are held)."""
        turns = self._turns.get(tenant)
        if turns is None:
            turns = self._turns[tenant] = asyncio.Semaphore(self.per_tenant)
        self._users[tenant] += 1
        try:
            async with turns:
                yield
        finally:
            self._users[tenant] -= 1
            if not self._users[tenant]:  # idle tenants keep no state
                del self._users[tenant], self._turns[tenant]

    def in_use(self) -> dict[str, int]:
        """Callers holding or waiting for a turn, per tenant (tenants with none are absent)."""
        return dict(self._users)

"""The node set the grpc tier talks to: membership, ring, and the background upkeep.

A :class:`ClusterView` is an immutable snapshot (node names -> clients, and their ring); a verb
takes one snapshot at its start and uses it to the end, so a membership change never changes
placement under a running call. :class:`Cluster` swaps in a new snapshot when the resolver
reports another node set: new names get (unopened) clients, vanished ones are *drained*: they
get no new calls, the calls already holding them finish, then their connections close.

One background thread per tier does all the upkeep: it re-resolves every
``resolve_interval_s``, probes down nodes after their backoff, closes the connections of nodes
idle for ``idle_close_s``, and closes drained nodes once no call holds them.

Threads: ``view`` may be read from any thread (a reference swap); ``refresh`` runs on the
background thread or a test's thread; ``close`` stops the thread and closes every client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from kvtier.config import GrpcTierConfig
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.membership import ResolveError, Resolver
from kvtier.tiers.remote.node import NodeClient
from kvtier.tiers.remote.placement import Ring

log = logging.getLogger(__name__)
_TICK_S = 1.0  # the longest the upkeep thread sleeps (idle and drain checks)


@dataclass(frozen=True)
class ClusterView:
    """One membership snapshot: ``clients`` by name and their ``ring`` (None when empty)."""

    clients: dict[str, NodeClient] = field(default_factory=dict)
    ring: Ring | None = None
    version: int = 0


class Cluster:
    def __init__(self, config: GrpcTierConfig, resolver: Resolver,
                 make_client: Callable[[str], NodeClient], name: str, periodic: bool) -> None:
        """``periodic``: resolve again every ``resolve_interval_s`` (not for a static list)."""
        self.config = config
        self._resolver = resolver
        self._periodic = periodic
        self._make_client = make_client
        self.view = ClusterView()
        self.draining: list[NodeClient] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._next_resolve = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"kvtier-{name}-upkeep", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # --- membership --------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Resolve once and apply the result; False when the resolver failed (the node set is
        kept). An empty answer is applied: every key then misses with ``node_down``."""
        try:
            names = sorted(set(self._resolver()))
        except ResolveError as exc:
            log.warning("grpc tier: discovery failed, keeping %d nodes: %s", len(self.view.clients), exc)
            return False
        finally:
            self._next_resolve = time.monotonic() + self.config.resolve_interval_s
        self.apply(names)
        return True

    def apply(self, names: Sequence[str]) -> None:
        """Make ``names`` the node set: add new clients, drain the vanished ones."""
        old = self.view
        wanted = set(names)
        if wanted == set(old.clients):
            return
        clients = {n: old.clients.get(n) or self._make_client(n) for n in sorted(wanted)}
        gone = [c for n, c in old.clients.items() if n not in wanted]
        ring = Ring(clients) if clients else None  # built before the swap: ~0.5 s at 1,000 nodes
        with self._wake:
            self.view = ClusterView(clients, ring, old.version + 1)
            self.draining.extend(gone)
            self._wake.notify()
        added = sorted(wanted - set(old.clients))
        if added or gone:
            log.info("grpc tier: membership v%d: %d nodes (+%s, -%s)", old.version + 1, len(clients),
                     added, [c.address for c in gone])

    # --- upkeep --------------------------------------------------------------------------------
    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                now = time.monotonic()
                view = self.view
                down = [c for c in view.clients.values() if not c.up]
                due = [c for c in down if c.next_probe <= now]
                resolve = self._periodic and now >= self._next_resolve
                if not due and not resolve:
                    waits = [c.next_probe - now for c in down] + [_TICK_S]
                    if self._periodic:
                        waits.append(self._next_resolve - now)
                    self._wake.wait(timeout=max(0.001, min(waits)))
                    if self._stopping:
                        return
            if resolve:
                self.refresh()
            for client in due:
                self._probe(client)
            self._close_idle_and_drained()

    def _probe(self, client: NodeClient) -> None:
        deadline = time.monotonic() + min(self.config.timeout_s, 1.0)
        try:
            client.fetch_info(deadline)
        except NodeError as exc:
            client.mark_down(str(exc))  # again, with a longer backoff
            return
        client.mark_up()

    def _close_idle_and_drained(self) -> None:
        for client in self.view.clients.values():
            if client.up:
                client.close_if_idle(self.config.idle_close_s)
        with self._wake:
            draining, self.draining = self.draining, []
        keep = []
        for client in draining:
            # A drained node closes once no call holds it; a call always ends by its deadline,
            # and a call still holding an older view is refused a reopened connection.
            if client.retire():
                self._close_client(client)
            else:
                keep.append(client)
        if keep:
            with self._wake:
                self.draining.extend(keep)

    def _close_client(self, client: NodeClient) -> None:
        try:
            client.close()
        except (grpc.RpcError, OSError) as exc:  # closing must not raise into anyone
            log.debug("grpc tier: closing %s: %s", client.address, exc)

    def close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)
        view, self.view = self.view, ClusterView()
        for client in [*view.clients.values(), *self.draining]:
            self._close_client(client)
        self.draining = []

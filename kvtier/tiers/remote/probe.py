"""A probe over replicas: how many leading keys some live replica holds, asked in waves.

Contract: ``Probe(hits, reason)`` where ``hits`` counts the leading keys that at least one
live replica confirmed, in order, and ``reason`` says why the run stopped at key ``hits``: the
miss reason of its best-ranked replica that answered, else ``timeout`` / the failure of a
replica that was asked, else ``node_down`` (no live replica). A key is counted as soon as any
replica confirms it; a slow or hung replica is not waited for once others settled the answer
(its call ends by the deadline by itself, and a NodeError it raises then still marks its node).
A replica that has stalled (calls unanswered for a while: :attr:`NodeClient.stalled`) is not
asked, nor waited for once it stalls: the probe moves on as if it had timed out.

How. The positions are asked in ``waves`` (ranges of positions; the tier passes groups in
waves of 4, 8, 16, ...); a wave's first round asks every live replica of its keys at once
(one Lookup per node for all its keys of the wave). A node's answer ``hits = h`` for its keys
``p[0..]`` says ``p[:h]`` are there and ``p[h]`` is not; ``p[h+1:]`` are *unknown* (not absent:
a hole on one replica must not hide keys the node still holds). So while the first key not yet
confirmed has a live replica that has not answered for it, that replica is asked again for
its keys from there on. The probe stops at a key that every live replica reported absent (or
failed on), and never starts a round once the deadline has passed (``timeout``).

Threads: runs on the caller's thread; node calls run on ``pool`` (a lone call with nothing
else in flight runs on the caller's thread: no hop).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from functools import partial

from kvtier.tiers.base import NODE_DOWN, TIMEOUT, Probe
from kvtier.tiers.remote.cluster import ClusterView
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.hedged import late_failure
from kvtier.tiers.remote.node import NodeClient

# Calls end by the deadline by themselves; the wait for them gets this much more before the
# probe gives up on them (a busy host's scheduling), so a late answer is not lost to a race.
_WAIT_SLACK_S = 0.25
_STALL_CHECK_S = 0.05  # how often a wait for a replica looks whether it has stalled
Failed = Callable[[NodeClient, NodeError], None]


def probe_replicas(view: ClusterView, keys: Sequence[bytes], placement: Sequence[Sequence[str]],
                   waves: Sequence[tuple[int, int]], pool: Executor, deadline: float, failed: Failed) -> Probe:
    """See the module docstring. ``placement[i]``: replica names of key ``i``, best first;
    ``failed(node, error)`` is told of every failed call (in flight ones too, when they end)."""
    run = _ProbeRun(view, keys, placement, pool, deadline, failed)
    try:
        for lo, hi in waves:
            stop = run.wave(lo, hi)
            if stop is not None:
                return stop
        return Probe(len(keys))
    finally:
        run.abandon()


class _ProbeRun:
    """One probe's state: what each replica said about each position. Caller's thread only."""

    def __init__(self, view: ClusterView, keys: Sequence[bytes], placement: Sequence[Sequence[str]],
                 pool: Executor, deadline: float, failed: Failed) -> None:
        self.view, self.keys, self.placement = view, keys, placement
        self.pool, self.deadline, self.failed = pool, deadline, failed
        self.present: set[int] = set()  # confirmed by some replica
        self.absent: dict[int, dict[str, str]] = defaultdict(dict)  # position -> node -> its miss reason
        self.broken: dict[str, str] = {}  # node -> reason its call failed (not asked again)
        self.asking: dict[str, set[int]] = defaultdict(set)  # node -> positions of its calls in flight
        self.pending: dict[Future[Probe], tuple[str, list[int]]] = {}

    def wave(self, lo: int, hi: int) -> Probe | None:
        """Settle positions [lo, hi): None when all are present, else where the run stops."""
        first: dict[str, list[int]] = defaultdict(list)
        for pos in range(lo, hi):
            for n in self.placement[pos]:
                if self._usable(n):
                    first[n].append(pos)
        if first and time.monotonic() >= self.deadline:
            return Probe(lo, TIMEOUT)  # a wave begun late would only find "no time left"
        self._ask(first)
        target = lo
        while True:
            while target < hi and target in self.present:
                target += 1
            if target == hi:
                self._drop_pending()  # their keys are settled: let them end on their own
                return None
            waiting, again = False, {}
            for n in self.placement[target]:
                if n in self.absent[target] or n in self.broken:
                    continue
                if target in self.asking[n]:
                    # Not for a node marked down meanwhile, nor one that stopped answering.
                    waiting = waiting or self._usable(n)
                elif self._usable(n):
                    again[n] = self._unknown(n, target, hi)
            if again:
                if time.monotonic() >= self.deadline:
                    return Probe(target, TIMEOUT)
                self._ask(again)
                continue
            if not waiting:
                return Probe(target, self._reason(target))
            left = self.deadline - time.monotonic()
            # Woken now and then to see whether the node waited for has stalled meanwhile.
            done, _ = wait(list(self.pending), timeout=min(max(0.0, left) + _WAIT_SLACK_S, _STALL_CHECK_S),
                           return_when=FIRST_COMPLETED)
            if not done:
                if time.monotonic() >= self.deadline + _WAIT_SLACK_S:
                    return Probe(target, TIMEOUT)
                continue
            for fut in done:
                self._settle(fut, *self.pending.pop(fut))

    def _up(self, n: str) -> bool:
        client = self.view.clients.get(n)
        return client is not None and client.up

    def _usable(self, n: str) -> bool:
        """Live, and answering: a stalled node (:attr:`NodeClient.stalled`) is given up on for
        this probe, as a ``timeout`` (it is not marked down: its calls' deadlines decide)."""
        if n in self.broken or not self._up(n):
            return False
        if self.view.clients[n].stalled:
            self.broken[n] = TIMEOUT
            return False
        return True

    def _unknown(self, n: str, start: int, hi: int) -> list[int]:
        """Positions in [start, hi) of node ``n`` that no replica confirmed and ``n`` has not
        reported absent: what ``n`` is asked again."""
        return [p for p in range(start, hi)
                if p not in self.present and n not in self.absent[p] and n in self.placement[p]]

    def _ask(self, batches: dict[str, list[int]]) -> None:
        for n, positions in batches.items():
            self.asking[n].update(positions)
        if len(batches) == 1 and not self.pending:  # nothing to race: on this thread
            ((n, positions),) = batches.items()
            fut: Future[Probe] = Future()
            try:
                fut.set_result(self._call(n, positions))
            except NodeError as exc:
                fut.set_exception(exc)
            self._settle(fut, n, positions)
            return
        for n, positions in batches.items():
            self.pending[self.pool.submit(self._call, n, positions)] = (n, positions)

    def _call(self, n: str, positions: list[int]) -> Probe:
        client = self.view.clients[n]
        with client.use(self.deadline, quick=True):
            return client.lookup([self.keys[p] for p in positions], self.deadline)

    def _settle(self, fut: Future[Probe], n: str, positions: list[int]) -> None:
        self.asking[n].difference_update(positions)
        try:
            result = fut.result()
        except NodeError as exc:
            self.broken[n] = exc.reason
            self.failed(self.view.clients[n], exc)
            return
        self.present.update(positions[: result.hits])
        if result.hits < len(positions):
            self.absent[positions[result.hits]][n] = result.reason

    def _reason(self, pos: int) -> str:
        said = self.absent.get(pos, {})
        for n in self.placement[pos]:
            if n in said:
                return said[n]
        reasons = [self.broken[n] for n in self.placement[pos] if n in self.broken]
        return TIMEOUT if TIMEOUT in reasons else (reasons[0] if reasons else NODE_DOWN)

    def _drop_pending(self) -> None:
        """Calls still running are no longer waited for; a failure they end with is still
        reported (it marks their node down)."""
        for fut, (n, positions) in self.pending.items():
            self.asking[n].difference_update(positions)
            fut.add_done_callback(partial(late_failure, client=self.view.clients[n], failed=self.failed))
        self.pending = {}

    def abandon(self) -> None:
        self._drop_pending()

"""A read over replicas: best live replica first, the next one on a miss, hedged when slow.

Each key is asked of its first live replica (one call per node for all its keys; a stalled
node, :attr:`NodeClient.stalled`, is passed over as if down, its keys missing with ``timeout``
when no other replica answers). A key that misses there is asked of its next replica in a
later round (a replica written while the first was down may hold it). With ``hedge_s`` > 0, the keys of a node that has not answered
``hedge_s`` after the round started are also asked of their next live replica at once, and
each key takes the first hit; the slow call is left to end by its deadline (a NodeError it
raises then still marks its node down).

Result per key: the bytes from whichever replica had them, else the miss of its best-ranked
replica that answered, else ``node_down`` (no replica live) or the failing call's reason.
When every key has one replica only, the same node, and there is no hedging, the read is
that one call on the caller's thread (no rounds: there is no other replica to move to).
Threads: runs on the caller's thread; node calls run on ``pool``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from functools import partial
from typing import TypeVar

from kvtier.tiers.base import NODE_DOWN, TIMEOUT, Miss
from kvtier.tiers.remote.cluster import ClusterView
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.node import NodeClient

V = TypeVar("V")
Fetch = Callable[[NodeClient, list[int], float], Sequence[V | Miss]]


def read_hedged(view: ClusterView, placement: Sequence[Sequence[str]], fetch: Fetch[V], pool: Executor,
                timeout_s: float, hedge_s: float,
                failed: Callable[[NodeClient, NodeError], None]) -> list[V | Miss]:
    deadline = time.monotonic() + timeout_s
    n = len(placement)
    only = _only_node(placement) if hedge_s <= 0 else None
    if only is not None:  # one replica, one node, nothing to race: one call, no rounds
        client = view.clients.get(only)
        if client is None or not client.up:
            return [Miss(NODE_DOWN)] * n
        if client.stalled:
            return [Miss(TIMEOUT)] * n
        try:
            with client.use(deadline):
                return list(fetch(client, list(range(n)), deadline))
        except NodeError as exc:
            failed(client, exc)
            return [Miss(exc.reason)] * n
    out: list[V | Miss] = [Miss(NODE_DOWN)] * n
    answered: set[int] = set()  # keys whose best reachable replica has given a reason
    done_keys: set[int] = set()  # keys served
    tried: list[set[str]] = [set() for _ in range(n)]

    stalled: set[int] = set()  # keys a stalled replica was skipped for

    def live_next(pos: int) -> str | None:
        for name in placement[pos]:
            client = view.clients.get(name)
            if name not in tried[pos] and client is not None and client.up:
                if not client.stalled:
                    return name
                stalled.add(pos)
        return None

    def call(name: str, positions: list[int]) -> Sequence[V | Miss]:
        client = view.clients[name]
        with client.use(deadline):
            return fetch(client, positions, deadline)

    def submit(batches: dict[str, list[int]]) -> dict[Future[Sequence[V | Miss]], tuple[str, list[int]]]:
        for name, positions in batches.items():
            for pos in positions:
                tried[pos].add(name)
        if len(batches) == 1 and hedge_s <= 0:  # one node, nothing to race: no thread hop
            ((name, positions),) = batches.items()
            fut: Future[Sequence[V | Miss]] = Future()
            try:
                fut.set_result(call(name, positions))
            except NodeError as exc:
                fut.set_exception(exc)
            return {fut: (name, positions)}
        return {pool.submit(call, name, positions): (name, positions) for name, positions in batches.items()}

    todo = list(range(n))
    while todo and time.monotonic() < deadline:
        batches: dict[str, list[int]] = defaultdict(list)
        for pos in todo:
            name = live_next(pos)
            if name is not None:
                batches[name].append(pos)
        if not batches:
            break
        round_start = time.monotonic()
        pending = submit(batches)
        hedged = hedge_s <= 0
        while pending:
            open_keys = {p for _, ps in pending.values() for p in ps if p not in done_keys}
            if not open_keys:
                break  # every key of the calls still running was served by another replica
            # Every call ends by the deadline itself (and marks its node down if it times
            # out), so once hedging is done the wait needs no timeout of its own.
            limit = None if hedged else max(0.0, round_start + hedge_s - time.monotonic())
            finished, _ = wait(list(pending), timeout=limit, return_when=FIRST_COMPLETED)
            if not finished:
                hedged = True
                extra: dict[str, list[int]] = defaultdict(list)
                for pos in sorted(open_keys):
                    name = live_next(pos)
                    if name is not None:
                        extra[name].append(pos)
                pending.update(submit(extra))
                continue
            for fut in finished:
                name, positions = pending.pop(fut)
                try:
                    values: Sequence[V | Miss] = fut.result()
                except NodeError as exc:
                    failed(view.clients[name], exc)
                    values = [Miss(exc.reason)] * len(positions)
                except BaseException:
                    # The caller's error (a chunk larger than its buffer): the round's other
                    # calls may still be receiving into the caller's buffers (get_into). They
                    # end by the deadline; the caller gets its buffers back only after that.
                    wait(list(pending))
                    raise
                for pos, value in zip(positions, values):
                    if pos in done_keys:
                        continue
                    if not isinstance(value, Miss):
                        out[pos] = value
                        done_keys.add(pos)
                    elif pos not in answered:  # report the best-ranked replica's reason
                        out[pos] = value
                        answered.add(pos)
        for fut, (name, _) in pending.items():  # abandoned slow calls: still mark their node
            fut.add_done_callback(partial(late_failure, client=view.clients[name], failed=failed))
        todo = [p for p in range(n) if p not in done_keys and live_next(p) is not None
                and not any(p in ps for _, ps in pending.values())]
    for pos in stalled - done_keys - answered:
        out[pos] = Miss(TIMEOUT)  # no replica answered; one was there but had stalled
    return out


def _only_node(placement: Sequence[Sequence[str]]) -> str | None:
    """The node name when every key has that one replica and no other, else None."""
    if not placement or len(placement[0]) != 1:
        return None
    first = placement[0]
    return first[0] if all(p == first for p in placement) else None


def late_failure(fut: Future[object], client: NodeClient, failed: Callable[[NodeClient, NodeError], None]) -> None:
    """Done-callback of a call nobody waits for any more: its NodeError still goes to ``failed``
    (a hung node is marked down when its call times out)."""
    exc = fut.exception()
    if isinstance(exc, NodeError):
        failed(client, exc)

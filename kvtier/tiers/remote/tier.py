"""The grpc tier: a client of a cluster of kvtier-server nodes.

Placement (``placement``, docs/placement.md): a consistent-hash ring over the node names; a
key lives on ``replication`` nodes. Through :meth:`GrpcTier.for_prefix` (the store's route)
``group_chunks`` consecutive chunks of a prefix share the nodes of their group's first key,
so a request touches about ceil(chunks / G) x R nodes; the plain verbs place every key by
itself. Writes go to the live replicas; reads ask the first live replica and move to the
next one on a miss; a read whose node has not answered after ``hedge_after`` x ``timeout_s``
also asks the next replica (hedging) and takes whichever answers first. A probe asks the
groups in waves (4, then 8, 16, ... groups) and stops at the first wave with a missing key,
so a short hit never asks the nodes of the groups behind it; a key counts once any live
replica confirms it (``probe``: holes on one replica hide nothing, a hung one is not waited for).

Membership (``cluster``): a static ``nodes`` list or ``discovery`` re-resolved in the
background; nodes that appear are used from the next call on, nodes that vanish are drained
(running calls finish, no new ones start). Connections open on first use and close when idle.

Deadlines: every verb computes one deadline (``timeout_s`` from its start) and every RPC or
data-path exchange gets the time left; per-node work runs in parallel, so a verb returns
within ``timeout_s`` plus scheduling noise whatever the nodes do.

Failure: a node that times out or fails at the transport is marked down (and its data path
closed); while down it gets no traffic and its keys miss with reason ``node_down``
(``timeout`` for the call that found out). A call that had no time left before it sent
anything is a ``timeout`` that marks nothing. The upkeep thread calls Info on down nodes after ``backoff_s``, doubling up to
``backoff_max_s``, and marks them up when they answer. Nothing is raised into the caller
except for caller bugs (``ValueError``) and use after ``close`` (``RuntimeError``).

Sync API, why: the contract is sync and grpc's sync stubs release the GIL while they wait,
so a verb blocks only its caller's thread; fan-out over several nodes uses a small thread
pool (one node and no hedging: no hop).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

from kvtier.chunk import header_names
from kvtier.config import GrpcTierConfig
from kvtier.errors import TierUnavailableError
from kvtier.tiers.base import (
    TIMEOUT,
    Entry,
    FilledEntry,
    Miss,
    Probe,
    TierBase,
    TierUsage,
    check_keys,
)
from kvtier.tiers.remote.channel import channel_credentials, read_token
from kvtier.tiers.remote.cluster import Cluster, ClusterView
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.hedged import read_hedged
from kvtier.tiers.remote.membership import Resolver, resolver_for, static_resolver
from kvtier.tiers.remote.node import NodeClient
from kvtier.tiers.remote.placement import place, probe_waves
from kvtier.tiers.remote.prefix import Prefix, PrefixVerbs
from kvtier.tiers.remote.probe import probe_replicas

log = logging.getLogger(__name__)
T = TypeVar("T")
V = TypeVar("V")
_CHECKED_AT_START = 3  # nodes whose Info (and credentials) a new tier checks


def is_whole_chunk(entry: Entry) -> bool:
    """The header (checksummed) names the entry's key and its length (payload checksum: the
    node checks it; a chunk corrupted in this process's memory still fails its batch)."""
    return header_names(entry.data, entry.key)


def byte_view(buf: memoryview) -> memoryview:
    """``buf`` as one flat run of bytes: the data paths slice, size and fill buffers by
    bytes, and a view of another format or shape would be sliced by its elements."""
    view = memoryview(buf)
    if not view.c_contiguous:
        raise ValueError(f"get_into needs C-contiguous buffers, got one of shape {view.shape} "
                         f"strides {view.strides}")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class GrpcTier(TierBase):
    """See the module docstring. Nodes come from ``resolver`` when given (tests), else from
    ``config.discovery``, else from ``config.nodes``."""

    def __init__(self, config: GrpcTierConfig, name: str = "grpc", resolver: Resolver | None = None) -> None:
        super().__init__()
        self.name = name
        self.config = config
        periodic = resolver is not None or bool(config.discovery)
        if resolver is None:
            resolver = self._config_resolver(config)
        token = read_token(config)
        creds = channel_credentials(config)
        self.cluster = Cluster(config, resolver, lambda n: NodeClient(n, config, token, creds), name, periodic)
        # One thread per node a verb waits on: a 512-chunk prompt at G=8, R=2 asks up to 128.
        self._pool = ThreadPoolExecutor(max_workers=128, thread_name_prefix=f"kvtier-{name}")
        self.cluster.refresh()
        self._check_start()
        self.cluster.start()

    @staticmethod
    def _config_resolver(config: GrpcTierConfig) -> Resolver:
        if config.discovery:
            try:
                return resolver_for(config.discovery)
            except ValueError as exc:
                raise TierUnavailableError(f"grpc tier: {exc}") from None
        if not config.nodes:
            raise TierUnavailableError("grpc tier: no nodes configured (grpc.nodes: [host:port, ...] "
                                       "or grpc.discovery: dns:HOST:PORT)")
        if len(set(config.nodes)) != len(config.nodes):
            raise TierUnavailableError(f"grpc tier: a node is listed twice in {config.nodes}")
        return static_resolver(config.nodes)

    def _check_start(self) -> None:
        """Info on a few nodes: an auth refusal by every one is a misconfiguration."""
        view = self.cluster.view
        deadline = time.monotonic() + min(self.config.timeout_s, 5.0)
        order = [n for n in self.config.nodes if n in view.clients] or sorted(view.clients)
        checked = order[:_CHECKED_AT_START]
        errors = self._fanout([(n, self._job(view.clients[n], deadline, lambda c: None)) for n in checked])
        refused = [e for e in errors.values() if isinstance(e, NodeError) and e.code in
                   ("UNAUTHENTICATED", "PERMISSION_DENIED")]
        if refused and len(refused) == len(checked):
            self.close()
            raise TierUnavailableError(f"grpc tier: every node refused the credentials: {refused[0]}")
        for n, e in errors.items():
            if isinstance(e, NodeError):
                view.clients[n].mark_down(str(e))

    # --- placement --------------------------------------------------------------------------------
    @property
    def nodes(self) -> list[NodeClient]:
        """The current members, by name."""
        view = self.cluster.view
        return [view.clients[n] for n in sorted(view.clients)]

    def replicas(self, key: bytes) -> list[str]:
        """Names of the nodes holding ``key`` placed by itself (the plain verbs), best first."""
        return self.placement([key])[0]

    def placement(self, keys: Sequence[bytes], prefix: Sequence[bytes] | None = None) -> list[list[str]]:
        """Replica names of each key; with ``prefix``, keys are placed by their group."""
        return self._placement(self.cluster.view, keys, Prefix(prefix) if prefix is not None else None)[1]

    def _placement(self, view: ClusterView, keys: Sequence[bytes], prefix: Prefix | None
                   ) -> tuple[list[bytes], list[list[str]]]:
        """(anchor key, replica names) of each key."""
        if view.ring is None:
            return list(keys), [[] for _ in keys]
        return place(view.ring, keys, prefix.keys if prefix is not None else None, self.config.group_chunks,
                     self.config.replication)

    def for_prefix(self, prefix: Sequence[bytes]) -> PrefixVerbs:
        return PrefixVerbs(self, Prefix(prefix))

    # --- fan-out ------------------------------------------------------------------------------------
    def _job(self, client: NodeClient, deadline: float, fn: Callable[[NodeClient], T]) -> Callable[[], T]:
        def run() -> T:
            with client.use(deadline):
                return fn(client)
        return run

    def _fanout(self, jobs: Sequence[tuple[str, Callable[[], T]]]) -> dict[str, T | NodeError]:
        """Run ``jobs`` (node name, call) in parallel; each call ends by the deadline itself."""
        if len(jobs) == 1:
            n, fn = jobs[0]
            try:
                return {n: fn()}
            except NodeError as exc:
                return {n: exc}
        futures: list[tuple[str, Future[T]]] = [(n, self._pool.submit(fn)) for n, fn in jobs]
        out: dict[str, T | NodeError] = {}
        for n, fut in futures:
            try:
                out[n] = fut.result()
            except NodeError as exc:
                out[n] = exc
        return out

    def _failed(self, client: NodeClient, exc: NodeError) -> None:
        if exc.down:
            client.mark_down(str(exc))
            self.cluster.wake()
        elif self._closed or exc.reason == TIMEOUT:
            # Calls in flight when the tier closed; a caller late (its queue, not the node):
            # a line per call would flood the log when a hung node starves the pool.
            log.debug("grpc tier: %s", exc)
        else:
            log.warning("grpc tier: %s", exc)

    @staticmethod
    def _live(view: ClusterView, names: Sequence[str]) -> list[str]:
        return [n for n in names if n in view.clients and view.clients[n].up]

    # --- verbs ----------------------------------------------------------------------------------------
    def _probe(self, keys: Sequence[bytes]) -> Probe:
        return self._probe_in(keys, None)

    def _probe_in(self, keys: Sequence[bytes], prefix: Prefix | None) -> Probe:
        if not keys:
            return Probe(0)
        deadline = time.monotonic() + self.config.timeout_s
        view = self.cluster.view
        anchors, placement = self._placement(view, keys, prefix)
        # Waves spare the nodes of later groups a short hit; when every key has the same
        # replicas (one node, say) there are none to spare: one request asks for them all.
        same = all(p == placement[0] for p in placement)
        waves = [(0, len(keys))] if same else probe_waves(anchors)
        return probe_replicas(view, keys, placement, waves, self._pool, deadline, self._failed)

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        return self._get_in(keys, None)

    def _get_in(self, keys: Sequence[bytes], prefix: Prefix | None) -> list[bytes | Miss]:
        check_keys(keys)
        self._check_open()
        return self._read(keys, prefix, lambda node, pos, deadline: node.get([keys[j] for j in pos], deadline))

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        return self._get_into_in(keys, outs, None)

    def _get_into_in(self, keys: Sequence[bytes], outs: Sequence[memoryview], prefix: Prefix | None
                     ) -> list[int | Miss]:
        """Chunk bytes land in ``outs`` directly (data path: ``recv_into`` the caller's buffer).
        Hedging is off here: two nodes must never write one caller buffer at once. Any
        C-contiguous buffer works (a float16 array's view, say): sizes and results are in
        bytes, the same on every data path; ValueError for one that is not contiguous."""
        check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"get_into got {len(keys)} keys and {len(outs)} buffers")
        outs = [byte_view(o) for o in outs]
        self._check_open()
        return self._read(keys, prefix, lambda node, pos, deadline: node.get_into(
            [keys[j] for j in pos], [outs[j] for j in pos], deadline), hedge=False)

    def get_visit(self, keys: Sequence[bytes], visit: Callable[[int, memoryview], None]) -> list[int | Miss]:
        """Hand each chunk found to ``visit(i, view)`` where it lies (on the shared-memory data
        path: in the segment, no copy into a buffer of ours), instead of returning it: per key
        its length or the miss. ``view`` is read-only and valid only during the call; the
        visitor verifies what it uses (only the header's key and length are checked here)
        and must not raise. Calls for different keys may come from different threads (one
        per node) and an index may be visited again after a failed attempt, so the visitor
        writes disjoint places and is idempotent. No hedging (as get_into)."""
        check_keys(keys)
        self._check_open()
        return self._read(keys, None, lambda node, pos, deadline: node.get_visit(
            [keys[j] for j in pos], lambda i, view: visit(pos[i], view), deadline), hedge=False)

    def _read(self, keys: Sequence[bytes], prefix: Prefix | None,
              fetch: Callable[[NodeClient, list[int], float], Sequence[V | Miss]],
              hedge: bool = True) -> list[V | Miss]:
        view = self.cluster.view
        _, placement = self._placement(view, keys, prefix)
        hedge_s = self.config.hedge_after * self.config.timeout_s if hedge and self.config.replication > 1 else 0.0
        return read_hedged(view, placement, fetch, self._pool, self.config.timeout_s, hedge_s, self._failed)

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        return self._put_in(entries, None)

    def _put_in(self, entries: Sequence[Entry], prefix: Prefix | None) -> list[bool]:
        check_keys([e.key for e in entries])
        self._check_open()
        whole = []
        for e in entries:
            whole.append(is_whole_chunk(e))
            if not whole[-1]:  # nodes refuse it, and with it the rest of its batch: drop it alone
                log.warning("grpc tier: not storing %s: not a whole chunk of that key", e.key.hex()[:16])
        return self._put_placed([e.key for e in entries], [len(e.data) for e in entries], whole, prefix,
                                lambda client, pos, deadline: client.put([entries[p] for p in pos], deadline))

    def put_filled(self, items: Sequence[FilledEntry]) -> list[bool]:
        """``put`` of chunks that each item's ``fill`` writes where the node's data path wants
        them (on shared memory: straight into the segment, no buffer of ours in between).
        The node verifies each chunk as it does for ``put``."""
        check_keys([i.key for i in items])
        self._check_open()
        return self._put_placed([i.key for i in items], [i.length for i in items], [True] * len(items), None,
                                lambda client, pos, deadline: client.put_filled([items[p] for p in pos], deadline))

    def _put_placed(self, keys: Sequence[bytes], sizes: Sequence[int], wanted: Sequence[bool],
                    prefix: Prefix | None, send: Callable[[NodeClient, list[int], float], list[bool]]) -> list[bool]:
        """Send chunk ``i`` (``sizes[i]`` bytes; skipped unless ``wanted[i]``) to its live
        replicas, ``send(node, positions, deadline)`` per node in parallel; per chunk whether
        some node stored it."""
        deadline = time.monotonic() + self.config.timeout_s
        view = self.cluster.view
        _, placement = self._placement(view, keys, prefix)
        per_node: dict[str, list[int]] = defaultdict(list)
        for pos in range(len(keys)):
            if wanted[pos]:
                for n in self._live(view, placement[pos]):
                    per_node[n].append(pos)

        def put_fitting(client: NodeClient, pos: list[int]) -> list[bool]:
            # The node's limit is known once it is open (Info), so it is applied here.
            fit = [p for p in pos if sizes[p] <= client.max_chunk_bytes]
            flags = dict(zip(fit, send(client, fit, deadline) if fit else []))
            return [flags.get(p, False) for p in pos]

        results = self._fanout([(n, self._job(view.clients[n], deadline, partial(put_fitting, pos=p)))
                                for n, p in per_node.items()])
        stored = [False] * len(keys)
        for n, result in results.items():
            if isinstance(result, NodeError):
                self._failed(view.clients[n], result)
                continue
            for pos, ok in zip(per_node[n], result):
                stored[pos] = stored[pos] or ok
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._delete_in(keys, None)

    def _delete_in(self, keys: Sequence[bytes], prefix: Prefix | None) -> int:
        check_keys(keys)
        self._check_open()
        deadline = time.monotonic() + self.config.timeout_s
        view = self.cluster.view
        _, placement = self._placement(view, keys, prefix)
        per_node: dict[str, list[int]] = defaultdict(list)
        for pos in range(len(keys)):
            for n in self._live(view, placement[pos]):
                per_node[n].append(pos)
        results = self._fanout([(n, self._job(view.clients[n], deadline, partial(
            NodeClient.delete, keys=[keys[j] for j in p], deadline=deadline))) for n, p in per_node.items()])
        existed = [False] * len(keys)
        for n, result in results.items():
            if isinstance(result, NodeError):
                self._failed(view.clients[n], result)
                continue
            for pos, flag in zip(per_node[n], result):
                existed[pos] = existed[pos] or flag
        return sum(existed)

    def usage(self) -> TierUsage:
        """This tenant's bytes summed over the live nodes (replicas counted once per node)."""
        self._check_open()
        deadline = time.monotonic() + self.config.timeout_s
        view = self.cluster.view
        live = self._live(view, sorted(view.clients))
        results = self._fanout([(n, self._job(view.clients[n], deadline, partial(NodeClient.stats, deadline=deadline)))
                                for n in live])
        used = cap = entries = 0
        for n, result in results.items():
            if isinstance(result, NodeError):
                self._failed(view.clients[n], result)
                continue
            for t in result.tenants:
                used += t.used_bytes
                cap += t.quota_bytes
                entries += t.entries
        return TierUsage(self.name, used, cap, entries)

    def nodes_down(self) -> list[str]:
        view = self.cluster.view
        return sorted(n for n, c in view.clients.items() if not c.up)

    def _close(self) -> None:
        self.cluster.close()
        # Queued calls still run, and fail at once (a closed node refuses calls): a cancelled
        # future would never wake the callers waiting on it (concurrent.futures.wait), and
        # its result() would raise CancelledError into them.
        self._pool.shutdown(wait=False)


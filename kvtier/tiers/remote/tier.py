"""The grpc tier: a client of one or more kvtier-server nodes.

Placement: rendezvous (highest-random-weight) hashing of each chunk key over the node
addresses; a key lives on its top ``replication`` nodes. Adding or removing a node moves only
the keys it gains or loses. Writes go to the live nodes among a key's replicas; reads try the
replicas in rank order, skipping down nodes, and move to the next replica when one misses.

Deadlines: every verb computes one deadline (``timeout_s`` from its start) and every RPC or
data-path exchange gets the time left; per-node work runs in parallel, so a verb returns
within ``timeout_s`` plus scheduling noise whatever the nodes do.

Failure: a node that times out or fails at the transport is marked down; while down it gets
no traffic and its keys miss with reason ``node_down`` (``timeout`` for the call that found
out). A background prober calls Info on down nodes after ``backoff_s``, doubling up to
``backoff_max_s``, and marks them up when they answer. Nothing is raised into the caller
except for caller bugs (``ValueError``) and use after ``close`` (``RuntimeError``).

Sync API, why: the contract is sync and grpc's sync stubs release the GIL while they wait,
so a verb blocks only its caller's thread; fan-out over several nodes uses a small thread
pool (one node: no hop). An asyncio loop in a background thread would add a cross-thread
handoff to every verb for no gain.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TypeVar

import grpc

from kvtier.chunk import decode_header
from kvtier.config import GrpcTierConfig
from kvtier.errors import ChunkError, TierUnavailableError
from kvtier.tiers.base import (
    ABSENT,
    NODE_DOWN,
    TIMEOUT,
    Entry,
    Miss,
    Probe,
    TierBase,
    TierUsage,
    check_keys,
)
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.node import NodeClient, channel_credentials, read_token
from kvtier.tiers.remote.placement import node_seed, rendezvous

log = logging.getLogger(__name__)
T = TypeVar("T")
V = TypeVar("V")


def is_whole_chunk(entry: Entry) -> bool:
    """The header (checksummed) names the entry's key and its length (payload checksum: the
    node checks it; a chunk corrupted in this process's memory still fails its batch)."""
    try:
        header = decode_header(entry.data)
    except ChunkError:
        return False
    return header.key == entry.key and header.nbytes == memoryview(entry.data).nbytes


class GrpcTier(TierBase):
    """See the module docstring. ``config.nodes`` must name at least one ``host:port``."""

    def __init__(self, config: GrpcTierConfig, name: str = "grpc") -> None:
        super().__init__()
        if not config.nodes:
            raise TierUnavailableError("grpc tier: no nodes configured (grpc.nodes: [host:port, ...])")
        if len(set(config.nodes)) != len(config.nodes):
            raise TierUnavailableError(f"grpc tier: a node is listed twice in {config.nodes}")
        self.name = name
        self.config = config
        self.replication = min(config.replication, len(config.nodes))
        token = read_token(config)
        creds = channel_credentials(config)
        self.nodes = [NodeClient(addr, config, token, creds) for addr in config.nodes]
        self._seeds = [node_seed(n.address) for n in self.nodes]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(self.nodes)),
                                        thread_name_prefix=f"kvtier-{name}")
        self._wake = threading.Condition()
        self._stopping = False
        self._connect_all()
        self._prober = threading.Thread(target=self._probe_loop, name=f"kvtier-{name}-prober", daemon=True)
        self._prober.start()

    # --- placement --------------------------------------------------------------------------------
    def replicas(self, key: bytes) -> list[int]:
        """Indexes of ``key``'s nodes, best first (rendezvous hashing)."""
        if len(self.nodes) == 1:
            return [0]
        return rendezvous(key, self._seeds, self.replication)

    # --- connection management -----------------------------------------------------------------
    def _connect_all(self) -> None:
        """Info on every node in parallel; an auth refusal everywhere is a misconfiguration."""
        deadline = time.monotonic() + min(self.config.timeout_s, 5.0)
        errors = self._fanout([(i, partial(self._connect, n, deadline)) for i, n in enumerate(self.nodes)])
        refused = [e for e in errors.values() if isinstance(e, NodeError) and e.code in
                   ("UNAUTHENTICATED", "PERMISSION_DENIED")]
        if refused and len(refused) == len(self.nodes):
            self.close()
            raise TierUnavailableError(f"grpc tier: every node refused the credentials: {refused[0]}")

    def _connect(self, node: NodeClient, deadline: float) -> None:
        try:
            node.fetch_info(deadline)  # also (re)opens the node's data path
        except NodeError as exc:
            node.mark_down(str(exc))
            raise
        node.mark_up()

    def _probe_loop(self) -> None:
        while True:
            with self._wake:
                if self._stopping:
                    return
                now = time.monotonic()
                due = [n for n in self.nodes if not n.up and n.next_probe <= now]
                if not due:
                    waits = [n.next_probe - now for n in self.nodes if not n.up]
                    self._wake.wait(timeout=min(waits) if waits else None)
                    continue
            for node in due:
                deadline = time.monotonic() + min(self.config.timeout_s, 1.0)
                try:
                    self._connect(node, deadline)
                except NodeError:
                    pass  # _connect marked it down again, with a longer backoff

    def _failed(self, node: NodeClient, exc: NodeError) -> None:
        if exc.down:
            node.mark_down(str(exc))
            with self._wake:
                self._wake.notify()
        else:
            log.warning("grpc tier: %s", exc)

    # --- fan-out ------------------------------------------------------------------------------------
    def _fanout(self, jobs: Sequence[tuple[int, Callable[[], T]]]) -> dict[int, T | NodeError]:
        """Run ``jobs`` (node index, call) in parallel; each call ends by the deadline itself."""
        if len(jobs) == 1:
            i, fn = jobs[0]
            try:
                return {i: fn()}
            except NodeError as exc:
                return {i: exc}
        futures: list[tuple[int, Future[T]]] = [(i, self._pool.submit(fn)) for i, fn in jobs]
        out: dict[int, T | NodeError] = {}
        for i, fut in futures:
            try:
                out[i] = fut.result()
            except NodeError as exc:
                out[i] = exc
        return out

    def _live(self, indexes: Sequence[int]) -> list[int]:
        return [i for i in indexes if self.nodes[i].up]

    # --- verbs ----------------------------------------------------------------------------------------
    def _probe(self, keys: Sequence[bytes]) -> Probe:
        if not keys:
            return Probe(0)
        deadline = time.monotonic() + self.config.timeout_s
        placement = [self.replicas(k) for k in keys]
        per_node: dict[int, list[int]] = defaultdict(list)  # node -> positions of its keys
        for pos, reps in enumerate(placement):
            for i in self._live(reps):
                per_node[i].append(pos)
        results = self._fanout([(i, partial(self.nodes[i].lookup, [keys[j] for j in p], deadline))
                                for i, p in per_node.items()])
        present: set[int] = set()
        failed: dict[int, str] = {}
        for i, result in results.items():
            if isinstance(result, NodeError):
                self._failed(self.nodes[i], result)
                failed[i] = result.reason
            else:
                present.update(per_node[i][: result.hits])
        for pos, reps in enumerate(placement):
            if pos not in present:
                return Probe(pos, self._miss_reason(reps, failed, results))
        return Probe(len(keys))

    def _miss_reason(self, reps: list[int], failed: dict[int, str], results: Mapping[int, object]) -> str:
        live = [i for i in reps if i in results and i not in failed]
        if live:
            first = results[live[0]]
            return first.reason if isinstance(first, Probe) else ABSENT
        reasons = [failed[i] for i in reps if i in failed]
        return TIMEOUT if TIMEOUT in reasons else (reasons[0] if reasons else NODE_DOWN)

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        check_keys(keys)
        self._check_open()
        return self._read(keys, lambda node, pos, deadline: node.get([keys[j] for j in pos], deadline))

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        """Chunk bytes land in ``outs`` directly (data path: ``recv_into`` the caller's buffer)."""
        check_keys(keys)
        if len(keys) != len(outs):
            raise ValueError(f"get_into got {len(keys)} keys and {len(outs)} buffers")
        self._check_open()
        return self._read(keys, lambda node, pos, deadline: node.get_into(
            [keys[j] for j in pos], [outs[j] for j in pos], deadline))

    def _read(self, keys: Sequence[bytes],
              fetch: Callable[[NodeClient, list[int], float], Sequence[V | Miss]]) -> list[V | Miss]:
        """Each key from its best live replica; a miss moves on to the next replica."""
        deadline = time.monotonic() + self.config.timeout_s
        out: list[V | Miss] = [Miss(NODE_DOWN)] * len(keys)  # left so: all replicas down
        answered: set[int] = set()  # positions whose first reachable replica has answered
        todo = {pos: self.replicas(k) for pos, k in enumerate(keys)}
        while todo and time.monotonic() < deadline:
            per_node: dict[int, list[int]] = defaultdict(list)
            for pos, reps in todo.items():
                live = self._live(reps)
                if live:
                    per_node[live[0]].append(pos)
            if not per_node:
                break
            results = self._fanout([(i, partial(fetch, self.nodes[i], p, deadline))
                                    for i, p in per_node.items()])
            next_todo: dict[int, list[int]] = {}
            for i, result in results.items():
                positions = per_node[i]
                values: Sequence[V | Miss]
                if isinstance(result, NodeError):
                    self._failed(self.nodes[i], result)
                    values = [Miss(result.reason)] * len(positions)
                else:
                    values = result
                for pos, value in zip(positions, values):
                    if not isinstance(value, Miss):
                        out[pos] = value
                        continue
                    if pos not in answered:  # report the best-ranked replica's reason
                        out[pos] = value
                        answered.add(pos)
                    rest = [r for r in todo[pos] if r != i]
                    if rest:  # a replica written while this one was down may have it
                        next_todo[pos] = rest
            todo = next_todo
        return out

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        self._check_open()
        deadline = time.monotonic() + self.config.timeout_s
        per_node: dict[int, list[int]] = defaultdict(list)
        for pos, e in enumerate(entries):
            if not is_whole_chunk(e):
                log.warning("grpc tier: not storing %s: not a whole chunk of that key", e.key.hex()[:16])
                continue  # nodes refuse it, and with it the rest of its batch: drop it alone
            for i in self._live(self.replicas(e.key)):
                if len(e.data) <= self.nodes[i].max_chunk_bytes:
                    per_node[i].append(pos)
        results = self._fanout([(i, partial(self.nodes[i].put, [entries[j] for j in p], deadline))
                                for i, p in per_node.items()])
        stored = [False] * len(entries)
        for i, result in results.items():
            if isinstance(result, NodeError):
                self._failed(self.nodes[i], result)
                continue
            for pos, ok in zip(per_node[i], result):
                stored[pos] = stored[pos] or ok
        return stored

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        self._check_open()
        deadline = time.monotonic() + self.config.timeout_s
        per_node: dict[int, list[int]] = defaultdict(list)
        for pos, k in enumerate(keys):
            for i in self._live(self.replicas(k)):
                per_node[i].append(pos)
        results = self._fanout([(i, partial(self.nodes[i].delete, [keys[j] for j in p], deadline))
                                for i, p in per_node.items()])
        existed = [False] * len(keys)
        for i, result in results.items():
            if isinstance(result, NodeError):
                self._failed(self.nodes[i], result)
                continue
            for pos, flag in zip(per_node[i], result):
                existed[pos] = existed[pos] or flag
        return sum(existed)

    def usage(self) -> TierUsage:
        """This tenant's bytes summed over the live nodes (replicas counted once per node)."""
        self._check_open()
        deadline = time.monotonic() + self.config.timeout_s
        live = self._live(range(len(self.nodes)))
        results = self._fanout([(i, partial(self.nodes[i].stats, deadline)) for i in live])
        used = cap = entries = 0
        for i, result in results.items():
            if isinstance(result, NodeError):
                self._failed(self.nodes[i], result)
                continue
            for t in result.tenants:
                used += t.used_bytes
                cap += t.quota_bytes
                entries += t.entries
        return TierUsage(self.name, used, cap, entries)

    def nodes_down(self) -> list[str]:
        return [n.address for n in self.nodes if not n.up]

    def _close(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if threading.current_thread() is not getattr(self, "_prober", None) and hasattr(self, "_prober"):
            self._prober.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for node in self.nodes:
            try:
                node.close()
            except (grpc.RpcError, OSError) as exc:  # closing must not raise into the caller
                log.debug("grpc tier: closing %s: %s", node.address, exc)

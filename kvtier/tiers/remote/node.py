"""One kvtier-server node as the grpc tier sees it: channel, RPCs, data path, liveness.

Every call takes an absolute ``deadline`` (``time.monotonic()`` seconds) and either returns
or raises :class:`NodeError` by then; a NodeError says whether the node itself failed
(``down``: transport error, timeout, auth refused) or only the request was refused.

Connections are lazy: nothing is opened until the first call (:meth:`NodeClient.use`), which
opens the channel and fetches Info (and with it the data path); :meth:`close_if_idle` closes
both again once no call has used them for a while, and the next call reopens them. So a client
of 100 nodes holds sockets only to the nodes its recent requests touched.

Data path: attached by Info; a verb's attach (the first call, a reopen after idle, a retry)
gets only a share of the verb's deadline (``_ATTACH_SHARE`` x ``timeout_s``), so that a data
port that swallows connections leaves the gRPC fallback most of the time. After a failed attach
or a broken path gRPC carries the bytes until a retry (:mod:`~kvtier.tiers.remote.data_slot`).
Marking the node down closes its data path (and with it the node's shared memory in this
process); Info re-attaches it when the node is back.

Liveness: ``up`` until a call fails with ``down`` (then probed with backoff); ``stalled`` while
calls wait unanswered, before the first of them times out (readers skip it meanwhile).

Threads: all methods may be called from any thread; the grpc channel is thread-safe, the
data-path connections are pooled (one caller per connection at a time) and liveness,
open/close state and which data path is current change under a lock; one caller at a time
claims a due re-attach.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import grpc

from kvtier.config import GrpcTierConfig
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc
from kvtier.tiers.base import ERROR, NODE_DOWN, TIMEOUT, Entry, FilledEntry, Miss, Probe, copy_into
from kvtier.tiers.remote.channel import advertised_data_path, channel_options
from kvtier.tiers.remote.data_path import SocketDataPath
from kvtier.tiers.remote.data_slot import DataSlot
from kvtier.tiers.remote.errors import REFUSALS, NodeError, rpc_error
from kvtier.tiers.remote.grpc_bytes import get_results, put_messages, visit_all

log = logging.getLogger(__name__)
B = TypeVar("B", bytes, memoryview)
R = TypeVar("R")
_ATTACH_SHARE = 0.1  # of timeout_s: what a verb's data-path attach may take of its deadline
_ATTACH_MIN_S = 0.05  # ...but at least this (a TLS or shm handshake on a short timeout_s)
_FAIR_SHARE = 0.5  # of timeout_s: a call given less that times out does not mark the node down
_STALL_SHARE = 0.25  # of timeout_s: calls unanswered this long make the node "stalled"
_STALL_MIN_S = 0.05  # ...but at least this
_STALL_USUAL = 4.0  # ...and this many times the node's usual lookup time
_QUICK_WEIGHT = 0.2  # of each answered lookup's time in that usual time


class NodeClient:
    def __init__(self, address: str, cfg: GrpcTierConfig, token: str,
                 credentials: grpc.ChannelCredentials | None) -> None:
        self.address = address
        self.cfg = cfg
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._credentials = credentials
        self.channel: grpc.Channel | None = None  # opened by the first call (use)
        self.stub: pb_grpc.KVTierStub | None = None
        self.info: pb.InfoReply | None = None
        self.max_chunk_bytes = cfg.max_message_bytes - (1 << 20)
        self.data_slot = DataSlot()
        self._token = token
        self.host = address.rsplit(":", 1)[0].strip("[]")
        self._lock = threading.Lock()
        self.up = True
        self.down_reason = ""
        self.backoff = cfg.backoff_s
        self.next_probe = 0.0
        self.inflight = 0  # calls between use() and its end
        self._quick_inflight = 0  # quick calls (lookups) between use() and their end
        self._owed_since = 0.0  # since when those calls wait for an answer (stalled)
        self._quick_s = 0.0  # the node's usual quick-call latency (moving average of answers)
        self.last_used = time.monotonic()
        self.opened = 0  # times the channel was opened (tests and stats)
        self.retired = False  # removed from the cluster: never opened again
        self.closed = False  # close() was called: final
        self._open_lock = threading.Lock()

    # --- lazy connection ---------------------------------------------------------------------------
    @contextmanager
    def use(self, deadline: float, quick: bool = False) -> Iterator[NodeClient]:
        """Hold the node for one call: opens the channel and fetches Info when closed (a
        NodeError when that fails) and keeps :meth:`close_if_idle` away until the call ends.
        A call that started with under ``_FAIR_SHARE`` of ``timeout_s`` left (queued behind
        others in the caller) and timed out is ``down=False``: not the node's fault (else one
        hung node starving the caller's pool gets healthy ones marked down too). ``quick``: a
        call a live node answers at once whatever its size (a lookup): see :attr:`stalled`."""
        start = time.monotonic()
        with self._lock:
            if self.retired:
                raise NodeError(NODE_DOWN, f"{self.address}: removed from the cluster", down=False)
            if self.closed:
                raise NodeError(NODE_DOWN, f"{self.address}: the client is closed", down=False)
            if quick:
                if self._quick_inflight == 0:
                    self._owed_since = start
                self._quick_inflight += 1
            self.inflight += 1
            self.last_used = start
        answered = False
        try:
            if self.info is None:
                with self._open_lock:
                    if self.info is None:
                        self.fetch_info(deadline, attach_share=True)
            yield self
            answered = True
            if quick:
                with self._lock:
                    self._quick_s += (time.monotonic() - start - self._quick_s) * _QUICK_WEIGHT
        except NodeError as exc:
            # A refusal is an answer; a timeout or a lost connection is not.
            answered = not exc.down and exc.reason not in (TIMEOUT, NODE_DOWN)
            given = deadline - start
            if exc.down and exc.reason == TIMEOUT and given < self.cfg.timeout_s * _FAIR_SHARE:
                raise NodeError(TIMEOUT, f"{exc} (the call started with {max(given, 0.0):.3f}s left: "
                                "not held against the node)", down=False, code=exc.code) from None
            raise
        finally:
            with self._lock:
                self.inflight -= 1
                self._quick_inflight -= quick
                self.last_used = time.monotonic()
                if answered:
                    self._owed_since = self.last_used

    def _ensure_channel(self) -> pb_grpc.KVTierStub:
        with self._lock:
            if self.closed:  # a call that was running when the client closed: no new channel
                raise NodeError(NODE_DOWN, f"{self.address}: the client is closed", down=False)
            if self.stub is None:
                options = channel_options(self.cfg)
                self.channel = (grpc.secure_channel(self.address, self._credentials, options)
                                if self._credentials is not None else grpc.insecure_channel(self.address, options))
                self.stub = pb_grpc.KVTierStub(self.channel)
                self.opened += 1
            return self.stub

    def retire(self) -> bool:
        """No new calls from now on (a drained node); True when no call holds it any more,
        so that it can be closed."""
        with self._lock:
            self.retired = True
            return self.inflight == 0

    @property
    def is_open(self) -> bool:
        return self.channel is not None

    def close_if_idle(self, idle_s: float) -> bool:
        """Close the channel and data path when no call holds the node and none has for
        ``idle_s`` seconds; True when it closed them."""
        with self._lock:
            if self.channel is None or self.inflight or time.monotonic() - self.last_used < idle_s:
                return False
            channel, data = self.channel, self.data_slot.take()
            self.channel = self.stub = self.info = None
        if data is not None:
            data.close()
        channel.close()
        log.debug("grpc tier: %s idle, connections closed", self.address)
        return True

    # --- liveness -------------------------------------------------------------------------------
    def mark_down(self, reason: str) -> bool:
        """Returns True when this call took the node down (it was up). Closes the data path:
        its idle connections (and their shared segments and the arena mapping) now, those
        that calls still hold when they are handed back; Info re-attaches it when the node
        is back (the upkeep probe)."""
        with self._lock:
            data = self.data_slot.take()
            was_up = self.up
            if was_up:
                self.backoff = self.cfg.backoff_s
            else:
                self.backoff = min(self.backoff * 2, self.cfg.backoff_max_s)
            self.up = False
            self.down_reason = reason
            # Jitter so that many clients do not probe a recovering node in lockstep.
            self.next_probe = time.monotonic() + self.backoff * random.uniform(0.8, 1.2)
        if data is not None:
            data.close()
        if was_up:
            log.warning("grpc tier: node %s down (%s); probing again in %.2fs", self.address, reason, self.backoff)
        return was_up

    @property
    def stalled(self) -> bool:
        """Two or more quick calls (lookups) in flight and no call answered for ``_STALL_SHARE``
        x ``timeout_s`` (and for ``_STALL_USUAL`` x the node's usual lookup time): a hung node
        before its first call times out and marks it down. Lookups and reads send it no more
        calls meanwhile (a replica or a ``timeout`` miss, not a thread held till the deadline).
        One lookup alone never makes it stalled (a node slow to answer it, a pause: its caller
        waits, as it would for any slow node), nor do bulk calls (a big PUT on a slow link)."""
        with self._lock:
            if self._quick_inflight < 2:
                return False
            owed = time.monotonic() - self._owed_since
            usual = self._quick_s
        return owed > max(self.cfg.timeout_s * _STALL_SHARE, usual * _STALL_USUAL, _STALL_MIN_S)

    def mark_up(self) -> None:
        with self._lock:
            was_down = not self.up
            self.up = True
            self.backoff = self.cfg.backoff_s
        if was_down:
            log.info("grpc tier: node %s is back", self.address)

    # --- control plane ---------------------------------------------------------------------------
    def _timeout(self, deadline: float) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise NodeError(TIMEOUT, f"{self.address}: no time left before the deadline", down=False)
        return left

    def fetch_info(self, deadline: float, attach_share: bool = False) -> pb.InfoReply:
        """Info, then the data path it advertises, attached by ``deadline`` or, with
        ``attach_share`` (a verb's call), by its share of it. NodeError when Info fails; a data
        path that fails only logs."""
        try:
            info = self._ensure_channel().Info(pb.InfoRequest(), timeout=self._timeout(deadline),
                                               metadata=self.metadata)
        except grpc.RpcError as exc:
            raise rpc_error(exc, f"{self.address} Info") from None
        self.info = info
        self.max_chunk_bytes = min(info.max_chunk_bytes, self.cfg.max_message_bytes - (1 << 20))
        self.attach_data_path(self._attach_deadline(deadline) if attach_share else deadline)
        return info

    def _attach_deadline(self, deadline: float) -> float:
        """A verb's data-path attach ends by this: its share of ``deadline``, the rest for the
        call itself (over gRPC when the attach fails)."""
        share = max(self.cfg.timeout_s * _ATTACH_SHARE, _ATTACH_MIN_S)
        return min(deadline, time.monotonic() + share)

    def attach_data_path(self, deadline: float) -> None:
        """Open the fastest data path ``config.data_path`` allows among those Info advertised
        (closing the current one: calls holding its connections finish first); on failure (or
        none advertised) chunk bytes use gRPC and a retry comes after the backoff (see the
        module docstring). Never raises NodeError."""
        old = self.data_slot.take()
        if old is not None:
            old.close()
        data = advertised_data_path(self.info, self.cfg, self.host, self._token, self.max_chunk_bytes)
        if data is None:
            return
        try:
            data.handshake(deadline)  # connect + handshake now: fail early
        except NodeError as exc:
            data.close()
            wait = self.data_slot.retry_later()
            log.warning("grpc tier: %s: data path unusable (%s); chunk bytes go over gRPC, retry in %.0fs",
                        self.address, exc, wait)
            return
        if self.data_slot.install(data):  # refused (and closed) when close() ran meanwhile
            log.debug("grpc tier: %s: chunk bytes over %s", self.address, data.kind)

    @property
    def data(self) -> SocketDataPath | None:
        """The data path chunk bytes take now; None: gRPC."""
        return self.data_slot.current

    def lookup(self, keys: Sequence[bytes], deadline: float) -> Probe:
        """Leading ``keys`` present: over the data path when the node serves LOOKUP there and a
        connection is free (a fraction of a gRPC call's fixed cost), else over gRPC. The data
        path failing falls back as a GET does (:meth:`_fast_or_grpc`)."""
        probe = self._fast_or_grpc(deadline, lambda data: data.lookup(keys, deadline), lambda: None)
        return probe if probe is not None else self.grpc_lookup(keys, deadline)

    def grpc_lookup(self, keys: Sequence[bytes], deadline: float) -> Probe:
        try:
            # The blocking call, not lookup_future().result(): a future starts a channel spin
            # thread per call (a thread start, milliseconds on a loaded host, per probe).
            reply = self._ensure_channel().Lookup(pb.LookupRequest(keys=keys), timeout=self._timeout(deadline),
                                                  metadata=self.metadata)
        except grpc.RpcError as exc:
            raise rpc_error(exc, f"{self.address} Lookup") from None
        return Probe(reply.hits, reply.reason or "absent")

    def delete(self, keys: Sequence[bytes], deadline: float) -> list[bool]:
        try:
            reply = self._ensure_channel().Delete(pb.DeleteRequest(keys=keys), timeout=self._timeout(deadline),
                                     metadata=self.metadata)
        except grpc.RpcError as exc:
            raise rpc_error(exc, f"{self.address} Delete") from None
        return list(reply.existed)

    def stats(self, deadline: float, tenant: str = "") -> pb.StatsReply:
        try:
            return self._ensure_channel().Stats(pb.StatsRequest(tenant=tenant), timeout=self._timeout(deadline),
                                   metadata=self.metadata)
        except grpc.RpcError as exc:
            raise rpc_error(exc, f"{self.address} Stats") from None

    # --- chunk bytes over gRPC ------------------------------------------------------------------
    def grpc_get(self, keys: Sequence[bytes], deadline: float) -> list[bytes | Miss]:
        try:
            replies = self._ensure_channel().Get(pb.GetRequest(keys=keys), timeout=self._timeout(deadline),
                                                 metadata=self.metadata)
            return get_results(self.address, keys, replies)
        except grpc.RpcError as exc:
            raise rpc_error(exc, f"{self.address} Get") from None

    def grpc_put(self, entries: Sequence[Entry], deadline: float) -> list[bool]:
        try:
            reply = self._ensure_channel().Put(put_messages(entries), timeout=self._timeout(deadline),
                                  metadata=self.metadata)
        except grpc.RpcError as exc:
            raise rpc_error(exc, f"{self.address} Put") from None
        stored = list(reply.stored)
        if len(stored) != len(entries):
            raise NodeError(ERROR, f"{self.address}: Put replied {len(stored)} flags for {len(entries)} chunks", down=True)
        return stored

    # --- chunk bytes, fastest path --------------------------------------------------------------
    def _data_path(self, deadline: float) -> SocketDataPath | None:
        """The current data path; when none and a retry is due, this caller (one only: the
        claim is made under the lock) attaches it within its share of ``deadline``."""
        if self.data is None and self.info is not None and self.data_slot.claim_retry():
            self.attach_data_path(self._attach_deadline(deadline))
        return self.data

    def get(self, keys: Sequence[bytes], deadline: float) -> list[bytes | Miss]:
        return self._fast_or_grpc(deadline, lambda data: data.get(keys, deadline),
                                  lambda: self.grpc_get(keys, deadline))

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], deadline: float) -> list[int | Miss]:
        return self._fast_or_grpc(deadline, lambda data: data.get_into(keys, outs, deadline),
                                  lambda: copy_into(self.grpc_get(keys, deadline), outs))

    def get_visit(self, keys: Sequence[bytes], visit: Callable[[int, memoryview], None],
                  deadline: float) -> list[int | Miss]:
        """``visit(i, view)`` for each chunk found, where it lies (SocketDataPath.get_visit)."""
        return self._fast_or_grpc(deadline, lambda data: data.get_visit(keys, visit, deadline),
                                  lambda: visit_all(self.grpc_get(keys, deadline), visit))

    def put(self, entries: Sequence[Entry], deadline: float) -> list[bool]:
        return self._fast_or_grpc(deadline, lambda data: data.put(entries, deadline),
                                  lambda: self.grpc_put(entries, deadline))

    def put_filled(self, items: Sequence[FilledEntry], deadline: float) -> list[bool]:
        """``put`` of chunks written by their ``fill`` (in the shared segment when there is one)."""
        return self._fast_or_grpc(deadline, lambda data: data.put(items, deadline),
                                  lambda: self.grpc_put([i.materialize() for i in items], deadline))

    def _fast_or_grpc(self, deadline: float, fast: Callable[[SocketDataPath], R],
                      grpc_call: Callable[[], R]) -> R:
        """Run ``fast`` on the bulk data path when there is one; fall back to ``grpc_call`` only
        when the path itself broke. A timeout or a refusal means the node answered (or is
        hung): that error propagates, since retrying over gRPC would only double the wait."""
        data = self._data_path(deadline)
        if data is not None:
            try:
                return fast(data)
            except NodeError as exc:
                if exc.reason == TIMEOUT or exc.code in REFUSALS:
                    raise
                self._data_failed(data, exc)
        return grpc_call()

    def _data_failed(self, data: SocketDataPath, exc: NodeError) -> None:
        """``data`` broke but the node may be fine: gRPC carries the bytes until the retry.
        Only the current path is dropped: one that mark_down or a newer attach already
        replaced stays as it is (closed, or the new one in use)."""
        if self.data_slot.failed(data):
            wait = self.data_slot.retry_later()
            log.warning("grpc tier: data path to %s failed (%s); using gRPC for %.0fs", self.address, exc, wait)

    def close(self) -> None:
        """Final: later calls raise NodeError, and none reopens a channel."""
        with self._lock:
            self.closed = True
            channel, data = self.channel, self.data_slot.shut()
            self.channel = self.stub = self.info = None
        if data is not None:
            data.close()
        if channel is not None:
            channel.close()


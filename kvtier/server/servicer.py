"""The gRPC side of kvtier-server: the ``kvtier.v1.KVTier`` service on grpc.aio.

Handlers are registered with identity deserializers: requests arrive as raw bytes and are
decoded by :mod:`kvtier.server.requests`, so a malformed message gets INVALID_ARGUMENT with a
message instead of grpc's INTERNAL. Every storage call runs in the thread executor (disk I/O
and multi-MiB copies must not stall the event loop); the loop only parses, authenticates and
streams.

Failure: a refused request is answered with its status (BadRequest/AuthError) and counted;
an unexpected exception is logged with its traceback and answered INTERNAL by grpc, and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import grpc
from grpc import aio

from kvtier import __version__
from kvtier.keys import KEY_BYTES
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.server.auth import Authenticator, AuthError, Tenant
from kvtier.server.fair_gate import FairGate
from kvtier.server.get_replies import encode_get_replies
from kvtier.server.metrics import ServerMetrics
from kvtier.server.requests import (
    BadRequest,
    Limits,
    decode_info,
    decode_keys,
    decode_put,
    decode_stats,
)
from kvtier.server.storage import Storage, TenantUsage
from kvtier.server.usage import UsageAggregator
from kvtier.tiers.base import Entry, Miss
from kvtier.usage.wire import ReportError, decode_report

log = logging.getLogger(__name__)
SERVICE = "kvtier.v1.KVTier"
_GET_BATCH = 8  # keys per executor call while streaming a Get
T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    kind: str
    port: int
    tls: bool
    address: str = ""


def tenant_of(auth: Authenticator, metadata: Sequence[tuple[str, Any]] | None) -> Tenant:
    value = None
    for key, val in metadata or ():
        if key == "authorization":
            value = val.decode() if isinstance(val, bytes) else str(val)
            break
    return auth.authenticate(value)


class KVTierServicer:
    """Owns nothing it is given; ``executor`` runs every storage call. Each batch of Get
    replies takes one of its tenant's ``get_turns_per_tenant`` turns
    (:class:`~kvtier.server.fair_gate.FairGate`)."""

    def __init__(self, storage: Storage, auth: Authenticator, limits: Limits, metrics: ServerMetrics,
                 executor: Executor, node_id: str, endpoints: Sequence[Endpoint] = (),
                 usage: UsageAggregator | None = None, get_turns_per_tenant: int = 2,
                 send_stall_s: float = 30.0) -> None:
        self.storage = storage
        self.auth = auth
        self.limits = limits
        self.metrics = metrics
        self.executor = executor
        self.node_id = node_id
        self.endpoints = list(endpoints)
        self.usage = usage if usage is not None else UsageAggregator()
        self.started = time.monotonic()
        self.gate = FairGate(get_turns_per_tenant)  # each tenant's turns for Get replies
        self.send_stall_s = send_stall_s

    def handler(self) -> grpc.GenericRpcHandler:
        def ser(msg: Any) -> bytes:
            return msg.SerializeToString()  # type: ignore[no-any-return]

        handlers = {
            "Info": grpc.unary_unary_rpc_method_handler(self._wrap("Info", self._info), response_serializer=ser),
            "Lookup": grpc.unary_unary_rpc_method_handler(self._wrap("Lookup", self._lookup), response_serializer=ser),
            "Delete": grpc.unary_unary_rpc_method_handler(self._wrap("Delete", self._delete), response_serializer=ser),
            "Stats": grpc.unary_unary_rpc_method_handler(self._wrap("Stats", self._stats), response_serializer=ser),
            "Put": grpc.stream_unary_rpc_method_handler(self._wrap("Put", self._put), response_serializer=ser),
            # Get replies are encoded on an executor thread (kvtier.server.get_replies).
            "Get": grpc.unary_stream_rpc_method_handler(self._get, response_serializer=bytes),
            # Engine usage reports (kvtier.usage.wire): JSON in, empty reply; not in the .proto.
            "ReportUsage": grpc.unary_unary_rpc_method_handler(
                self._wrap("ReportUsage", self._report_usage), response_serializer=bytes),
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # --- plumbing -----------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, partial(fn, *args))

    def _tenant(self, context: aio.ServicerContext) -> Tenant:
        return tenant_of(self.auth, context.invocation_metadata())

    def _wrap(self, method: str, body: Callable[[Any, aio.ServicerContext], Awaitable[Any]]
              ) -> Callable[[Any, aio.ServicerContext], Awaitable[Any]]:
        async def handle(request: Any, context: aio.ServicerContext) -> Any:
            start = time.perf_counter()
            code = "OK"
            try:
                return await body(request, context)
            except (BadRequest, AuthError) as exc:
                code = self._refused(exc)
                await context.abort(_status(exc), exc.message)
            finally:
                self.metrics.requests.labels(method, code).inc()
                self.metrics.seconds.labels(method).observe(time.perf_counter() - start)
        return handle

    def _refused(self, exc: BadRequest | AuthError) -> str:
        code = _status(exc)
        if isinstance(exc, AuthError):
            self.metrics.auth_failures.labels(code.name).inc()
        elif "Put item" in exc.message:
            self.metrics.rejected.labels(code.name).inc()
        log.debug("refused: %s %s", code.name, exc.message)
        return code.name

    # --- RPCs ---------------------------------------------------------------------------------
    async def _info(self, raw: bytes, context: aio.ServicerContext) -> pb.InfoReply:
        tenant = self._tenant(context)
        decode_info(raw)
        reply = pb.InfoReply(
            server_version=__version__, key_bytes=KEY_BYTES,
            max_message_bytes=self.limits.max_message_bytes, max_chunk_bytes=self.limits.max_chunk_bytes,
            max_batch_keys=self.limits.max_batch_keys, tenant=tenant.name,
            auth_required=self.auth.enabled, node_id=self.node_id)
        for ep in self.endpoints:
            reply.data_endpoints.add(kind=ep.kind, address=ep.address, port=ep.port, tls=ep.tls)
        return reply

    async def _lookup(self, raw: bytes, context: aio.ServicerContext) -> pb.LookupReply:
        store = self.storage.store(self._tenant(context).name)
        keys = decode_keys(raw, "Lookup", self.limits)
        probe = await self._run(store.probe, keys)
        return pb.LookupReply(hits=probe.hits, reason=probe.reason)

    async def _delete(self, raw: bytes, context: aio.ServicerContext) -> pb.DeleteReply:
        store = self.storage.store(self._tenant(context).name)
        keys = decode_keys(raw, "Delete", self.limits)
        existed = await self._run(store.delete, keys)
        return pb.DeleteReply(deleted=sum(existed), existed=existed)

    async def _stats(self, raw: bytes, context: aio.ServicerContext) -> pb.StatsReply:
        caller = self._tenant(context)
        tenants = self.auth.authorize_stats(caller, decode_stats(raw))
        usages = await self._run(lambda: [self.storage.store(t.name).usage() for t in tenants])
        reply = pb.StatsReply(node_id=self.node_id, uptime_s=time.monotonic() - self.started)
        for u in usages:
            _fill_tenant(reply.tenants.add(), u)
        return reply

    async def _report_usage(self, raw: bytes, context: aio.ServicerContext) -> bytes:
        tenant = self._tenant(context)  # the tenant is whoever the token says, never the payload
        try:
            report = decode_report(raw)
        except ReportError as exc:
            raise BadRequest(grpc.StatusCode.INVALID_ARGUMENT, f"ReportUsage: {exc}") from None
        self.usage.apply(tenant.name, report)
        return b""

    async def _put(self, requests: AsyncIterator[bytes], context: aio.ServicerContext) -> pb.PutReply:
        """All or nothing over the whole stream, as a data-path batch: when a message is
        refused, the chunks earlier messages of this call newly stored are removed (chunks
        that were there before stay)."""
        store = self.storage.store(self._tenant(context).name)
        stored: list[bool] = []
        new_keys: list[bytes] = []
        try:
            async for raw in requests:
                # No turn here: a turn per message left the executor idle between a tenant's
                # puts (-30% Put throughput) for little gain (bench/tenant_flood.py --flood put).
                stored.extend(await self._run(self._decode_and_put, store, raw, len(stored), new_keys))
        except BadRequest:
            if new_keys:
                await self._run(store.delete, new_keys)
            raise
        return pb.PutReply(stored=stored)

    def _decode_and_put(self, store: Any, raw: bytes, first: int, new_keys: list[bytes]) -> list[bool]:
        """One message's items, verified, then stored; the keys it newly stored are added
        to ``new_keys``."""
        entries: list[Entry] = decode_put(raw, self.limits, first)
        new = [not store.holds(e.key) for e in entries]
        results: list[bool] = store.put(entries)
        new_keys.extend(e.key for e, ok, fresh in zip(entries, results, new) if ok and fresh)
        self.metrics.bytes.labels("in", "grpc").inc(sum(len(e.data) for e in entries))
        return results

    async def _get(self, raw: bytes, context: aio.ServicerContext) -> None:
        """Streams the replies with ``context.write``, each batch under one of the tenant's
        turns. A client that takes no reply for ``send_stall_s`` (it stopped reading, or hung
        with no deadline) gives the turn back: the call goes on without it, so the tenant's
        other Gets are not held up for as long as that client is."""
        start = time.perf_counter()
        code = "OK"
        try:
            tenant = self._tenant(context).name
            store = self.storage.store(tenant)
            keys = decode_keys(raw, "Get", self.limits)
        except (BadRequest, AuthError) as exc:
            code = self._refused(exc)
            self.metrics.requests.labels("Get", code).inc()
            await context.abort(_status(exc), exc.message)
        # Replies stay under grpc's default 4 MiB receive limit (a client with default options
        # can read them) unless a single chunk is bigger; Info advertises the real maximum.
        budget = min(self.limits.max_message_bytes, 4 << 20) - (64 << 10)
        sent = 0
        writing: asyncio.Future[None] | None = None
        try:
            for base in range(0, len(keys), _GET_BATCH):
                async with self.gate.turn(tenant):  # held until grpc has taken the messages
                    messages, nbytes = await self._run(_get_batch, store, keys[base : base + _GET_BATCH],
                                                       base, budget)
                    writing, rest = await _write_within(context, messages, self.send_stall_s)
                if writing is not None:  # stalled: the rest without the turn
                    log.info("Get of tenant %r: the client took no reply for %gs; its turn goes back",
                             tenant, self.send_stall_s)
                    await writing
                    for message in rest:
                        await context.write(message)
                    writing = None
                sent += nbytes
        finally:
            if writing is not None:
                writing.cancel()  # the call is ending (cancelled by the client, or an error)
            self.metrics.bytes.labels("out", "grpc").inc(sent)
            self.metrics.requests.labels("Get", code).inc()
            self.metrics.seconds.labels("Get").observe(time.perf_counter() - start)


async def _write_within(context: aio.ServicerContext, messages: Sequence[bytes], stall_s: float
                        ) -> tuple[asyncio.Future[None] | None, list[bytes]]:
    """Write ``messages`` in order; when one is not taken within ``stall_s``, return its
    write (still running: never cancelled here, a cancelled write breaks the call) and the
    messages after it. ``(None, [])`` when all were taken."""
    for i, message in enumerate(messages):
        write = asyncio.ensure_future(context.write(message))
        try:
            done, _ = await asyncio.wait({write}, timeout=stall_s)
        except BaseException:  # the call is ending (the client cancelled): so is its write
            write.cancel()
            raise
        if not done:
            return write, list(messages[i + 1 :])
        write.result()  # a failed write raises here
    return None, []


def _get_batch(store: Any, keys: Sequence[bytes], first: int, budget: int) -> tuple[list[bytes], int]:
    values = store.get(keys)
    return encode_get_replies(values, first, budget), sum(len(v) for v in values if not isinstance(v, Miss))


def _status(exc: BadRequest | AuthError) -> grpc.StatusCode:
    if isinstance(exc, BadRequest):
        return exc.code
    return getattr(grpc.StatusCode, exc.code)  # type: ignore[no-any-return]


def _fill_tenant(msg: pb.TenantStats, u: TenantUsage) -> None:
    msg.tenant = u.tenant
    msg.used_bytes = u.used_bytes
    msg.quota_bytes = u.quota_bytes
    msg.entries = u.entries
    msg.evictions = u.evictions
    for t in u.tiers:
        msg.tiers.add(name=t.name, used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes, entries=t.entries)

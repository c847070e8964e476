"""kvtier-server assembled: storage, auth, the gRPC service, Health, the HTTP side port and
the bulk data path, with a start that binds every listener and a stop that drains them.

Lifecycle (all on one asyncio loop, see :func:`serve`):
``start()`` builds the tenant stores (rebuilding disk indexes), binds gRPC, HTTP and the data
path, marks Health SERVING and writes the ready file. ``stop()`` (SIGTERM/SIGINT) marks Health
NOT_SERVING, stops accepting, lets in-flight RPCs and data-path requests finish within
``grace_s``, then closes the tiers (every acknowledged Put is already on disk) and removes the
ready file. A second signal during the drain is ignored; ``kill -9`` is always safe for data.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import ssl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Gauge

from kvtier import __version__
from kvtier.server.auth import Authenticator
from kvtier.server.config import ServerConfig
from kvtier.server.fd_limits import LoopAcceptErrors, raise_open_files_limit
from kvtier.server.http import HttpSide
from kvtier.server.lower import LowerCollector, store_factory
from kvtier.server.metrics import ServerMetrics
from kvtier.server.requests import Limits
from kvtier.server.servicer import SERVICE, Endpoint, KVTierServicer
from kvtier.server.storage import Storage
from kvtier.server.usage import MAX_USAGE_TENANTS, UsageAggregator
from kvtier.server.usage_metrics import EngineUsageCollector
from kvtier.tiers.redis.conn import parse_url

log = logging.getLogger("kvtier.server")


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def grpc_server_options(cfg: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        # grpc sets SO_REUSEPORT by default: a second server on a busy port would then bind
        # "successfully" and split the traffic. Fail loudly instead.
        ("grpc.so_reuseport", 0),
        # Large flow-control windows: chunks are MiBs, the default 64 KiB window stalls them.
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.max_frame_size", (1 << 24) - 1),
        ("grpc.http2.write_buffer_size", 8 << 20),
    ]


def server_ssl_context(cfg: ServerConfig) -> ssl.SSLContext | None:
    if not cfg.tls:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(os.path.expanduser(cfg.tls_cert), os.path.expanduser(cfg.tls_key))
    if cfg.tls_client_ca:
        ctx.load_verify_locations(os.path.expanduser(cfg.tls_client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class KVTierServer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self.auth = Authenticator.from_file(cfg.tokens_file)
        self.node_id = cfg.node_id or f"{socket.gethostname()}:{os.getpid()}"
        self.storage: Storage | None = None
        self.metrics: ServerMetrics | None = None
        self.grpc_server: aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.http: HttpSide | None = None
        self.data: Any = None  # kvtier.server.dataplane.DataPlane when the data path is on
        self.events: Any = None  # kvtier.server.events.EventSink when events_endpoint is set
        self.executor = ThreadPoolExecutor(max_workers=cfg.workers, thread_name_prefix="kvtier-io")
        self.ports: dict[str, int] = {}
        self.started = time.monotonic()
        self.draining = False
        # What engines report (ReportUsage), for /api/cluster. Every tenant of the tokens file
        # keeps its own name there: past the cap two tenants' replicas of one name met in one
        # ("other", model, replica) entry, each report undoing the other's counters.
        self.usage = UsageAggregator(bucket_s=cfg.usage_bucket_s,
                                     max_tenants=max(MAX_USAGE_TENANTS, len(self.auth.tenants)))

    async def start(self) -> dict[str, int]:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.storage = await loop.run_in_executor(self.executor, lambda: Storage(
            self.auth.tenants.values(), cfg.cpu, cfg.disk, cfg.default_quota_bytes,
            store_factory=store_factory(cfg), shareable_ram=cfg.arena_reads and cfg.shm_bytes > 0))
        self.metrics = ServerMetrics(self.storage, label_values=cfg.metrics_label_values)
        self.metrics.registry.register(LowerCollector(self.storage, self.metrics.tenant_label))
        self.metrics.registry.register(EngineUsageCollector(self.usage))
        declare_node_capacity(self.metrics.registry, self.capacity_bytes())
        limits = Limits(cfg.max_batch_keys, min(cfg.max_chunk_bytes, self.storage.max_chunk_bytes()),
                        cfg.max_message_bytes)
        tls_ctx = server_ssl_context(cfg)
        if cfg.events_endpoint:
            from kvtier.server.events import EventsCollector, EventSink, attach

            self.events = EventSink(cfg.events_endpoint, self.node_id, topic=cfg.events_topic,
                                    max_queue=cfg.events_max_queue)
            attach(list(self.storage.stores.values()), self.events)
            self.metrics.registry.register(EventsCollector(self.events))
        endpoints: list[Endpoint] = []
        if cfg.data_port >= 0:
            from kvtier.server.dataplane import DataPlane

            self.data = DataPlane(self.storage, self.auth, limits, self.metrics, tls_ctx,
                                  cfg.max_data_connections, cfg.shm_bytes,
                                  cfg.max_unauthenticated_connections, cfg.handshake_timeout_s,
                                  cfg.max_data_connections_per_tenant, cfg.arena_reads)
            self.ports["data"] = self.data.start(cfg.host, cfg.data_port)
            endpoints.append(Endpoint("socket", self.ports["data"], tls_ctx is not None))
            if self.data.shm_bytes:  # same data port: SHM_OPEN upgrades a connection
                endpoints.append(Endpoint("shm", self.ports["data"], tls_ctx is not None))
        servicer = KVTierServicer(self.storage, self.auth, limits, self.metrics, self.executor,
                                  self.node_id, endpoints, self.usage,
                                  get_turns_per_tenant=cfg.grpc_get_turns_per_tenant,
                                  send_stall_s=cfg.grpc_send_stall_s)
        server = aio.server(options=grpc_server_options(cfg))
        server.add_generic_rpc_handlers((servicer.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        address = hostport(cfg.host, cfg.port)
        if tls_ctx is not None:
            creds = grpc.ssl_server_credentials(
                [(_read(cfg.tls_key), _read(cfg.tls_cert))],
                root_certificates=_read(cfg.tls_client_ca) if cfg.tls_client_ca else None,
                require_client_auth=bool(cfg.tls_client_ca))
            self.ports["grpc"] = server.add_secure_port(address, creds)
        else:
            self.ports["grpc"] = server.add_insecure_port(address)
        await server.start()
        self.grpc_server = server
        if cfg.http_port >= 0:
            self.http = HttpSide(self.stats_document, self.metrics.exposition, lambda: not self.draining,
                                 peers=cfg.peers)
            self.ports["http"] = await self.http.start(cfg.host, cfg.http_port)
        for service in ("", SERVICE):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._announce()
        return self.ports

    def _announce(self) -> None:
        cfg = self.cfg
        parts = [f"grpc={hostport(cfg.host, self.ports['grpc'])}{' (TLS)' if cfg.tls else ''}"]
        parts += [f"{k}={hostport(cfg.host, v)}" for k, v in self.ports.items() if k != "grpc"]
        auth = f"auth on ({len(self.auth.tenants)} tenants)" if self.auth.enabled else "auth off"
        disk = f"disk={cfg.disk.path}" if cfg.disk.enabled else "no disk (RAM only)"
        lower = f"; lower tier redis at {parse_url(cfg.redis.url).display}" if cfg.lower == "redis" else ""
        log.info("kvtier-server %s listening: %s; %s; %s%s", __version__, " ".join(parts), auth, disk, lower)
        if cfg.ready_file:
            doc = {"pid": os.getpid(), "host": cfg.host, "node_id": self.node_id,
                   **{f"{k}_port": v for k, v in self.ports.items()}}
            path = Path(cfg.ready_file)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, path)

    def capacity_bytes(self) -> dict[str, int]:
        """Per tier of this node, the budget its tenants share (``cpu``, ``disk``)."""
        cfg = self.cfg
        return {name: tier.capacity_bytes for name, tier in (("cpu", cfg.cpu), ("disk", cfg.disk)) if tier.enabled}

    def stats_document(self) -> dict[str, Any]:
        assert self.storage is not None
        return {
            "node_id": self.node_id, "version": __version__, "uptime_s": time.monotonic() - self.started,
            "ports": self.ports, "draining": self.draining, "capacity_bytes": self.capacity_bytes(),
            "tenants": [_tenant_dict(s) for s in self.storage.stores.values()],
            "usage": self.usage.document(),
        }

    async def stop(self) -> None:
        if self.draining:
            return
        self.draining = True
        log.info("draining: no new requests; in-flight ones get %.1fs", self.cfg.grace_s)
        await self.health.enter_graceful_shutdown()
        if self.data is not None:
            self.data.stop_accepting()
        if self.grpc_server is not None:
            await self.grpc_server.stop(self.cfg.grace_s)
        if self.data is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.data.join, self.cfg.grace_s)
        if self.http is not None:
            await self.http.stop()
        self.executor.shutdown(wait=True)
        if self.storage is not None:
            self.storage.close()
        if self.events is not None:
            self.events.close()
        if self.cfg.ready_file:
            Path(self.cfg.ready_file).unlink(missing_ok=True)
        log.info("stopped cleanly")


def declare_node_capacity(registry: CollectorRegistry, capacity: dict[str, int]) -> None:
    """``kvtier_server_node_capacity_bytes{tier}``: the node's budget per tier, what Grafana
    divides used bytes by. The tenants' own capacities (``kvtier_server_tier_capacity_bytes``)
    may each be the whole budget, so their sum is not what the node holds."""
    gauge = Gauge("kvtier_server_node_capacity_bytes", "Bytes a tier of this node holds, all tenants "
                  "together (its budget)", ["tier"], registry=registry)
    for tier, nbytes in capacity.items():
        gauge.labels(tier).set(nbytes)


def _read(path: str) -> bytes:
    return Path(path).expanduser().read_bytes()


def _tenant_dict(store: Any) -> dict[str, Any]:
    """_usage_dict plus request traffic and per-tier evictions (by reason: a server tier
    evicts only to stay within its capacity) for the cluster dashboard."""
    usage = store.usage()
    doc = {**_usage_dict(usage), **store.traffic.snapshot()}
    for tier, tier_usage in zip(doc["tiers"], usage.tiers):
        tier["evictions"] = {"capacity": tier_usage.evictions}
    return doc


def _usage_dict(u: Any) -> dict[str, Any]:
    return {"tenant": u.tenant, "used_bytes": u.used_bytes, "quota_bytes": u.quota_bytes,
            "entries": u.entries, "evictions": u.evictions,
            "tiers": [{"name": t.name, "used_bytes": t.used_bytes, "chunk_bytes": t.chunk_bytes,
                       "capacity_bytes": t.capacity_bytes, "entries": t.entries} for t in u.tiers]}


async def serve(cfg: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT, then drain and return the exit status (0 after a clean stop)."""
    server = KVTierServer(cfg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(LoopAcceptErrors())
    log.info("open-files limit: %d", raise_open_files_limit())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    await stop.wait()
    await server.stop()
    return 0

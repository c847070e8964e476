"""kvtier-server configuration: frozen dataclasses loaded from YAML, environment and flags.

Precedence (lowest first): defaults < YAML file (``--config``) < ``KVTIER_SERVER_*``
environment < command-line flags. Environment names follow kvtier.config:
``KVTIER_SERVER_PORT=7000``, ``KVTIER_SERVER_DISK__PATH=/mnt/nvme/kvtier``. The storage
sections reuse the client's ``CpuTierConfig`` / ``DiskTierConfig``: the server holds each
tenant's chunks in a RAM tier over an optional disk tier (see :mod:`kvtier.server.storage`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    deep_merge,
    env_to_dict,
    from_dict,
    read_yaml,
    value_range,
)
from kvtier.errors import ConfigError
from kvtier.protocol.addresses import is_loopback, parse_hostport
from kvtier.server.auth import MIN_QUOTA_BYTES

MiB = 1 << 20
GiB = 1 << 30
ENV_PREFIX = "KVTIER_SERVER_"
DEFAULT_PORT = 50051
DEFAULT_HTTP_PORT = 50052
DEFAULT_DATA_PORT = 50053


def _port(default: int) -> Any:
    # -1 disables the listener, 0 asks the kernel for a free port (logged and written to the
    # ready file), anything else is that port.
    return field(default=default, metadata=value_range(-1, 65535))


@dataclass(frozen=True)
class ServerConfig:
    """Everything kvtier-server reads at start. Immutable; a change needs a restart."""

    host: str = "127.0.0.1"
    port: int = _port(DEFAULT_PORT)
    http_port: int = _port(DEFAULT_HTTP_PORT)
    data_port: int = _port(DEFAULT_DATA_PORT)
    # Plain-text listeners on a non-loopback address leak tokens and chunks; refused unless set.
    allow_insecure_remote: bool = False
    node_id: str = ""
    # Other servers' HTTP side ports (host:http_port) shown on this node's /dashboard; this
    # node may be listed too (skipped by node id), so every node can share one list.
    peers: tuple[str, ...] = ()
    # Width of one point of the engines' hit-ratio-over-time chart (90 points are kept).
    usage_bucket_s: float = field(default=10.0, metadata=value_range(0.5, 3600))
    # Auth: empty = off (one tenant, "default"). Format in kvtier.server.auth.
    tokens_file: str = ""
    # Quota (a cap on RAM and on disk, within the shared budgets) of tenants whose token line
    # names none; 0 = no cap but the budget (every tenant is still guaranteed capacity // n).
    default_quota_bytes: int = field(default=0, metadata=value_range(0, None, size=True))
    # Distinct tenants /metrics names before the rest are summed into tenant="other".
    metrics_label_values: int = field(default=64, metadata=value_range(0, 100_000))
    tls_cert: str = ""
    tls_key: str = ""
    # CA bundle that client certificates must chain to; set = mutual TLS required.
    tls_client_ca: str = ""
    max_message_bytes: int = field(default=64 * MiB, metadata=value_range(1 * MiB, 1 * GiB, size=True))
    max_chunk_bytes: int = field(default=32 * MiB, metadata=value_range(4096, 1 * GiB, size=True))
    max_batch_keys: int = field(default=4096, metadata=value_range(1, 1 << 20))
    # Threads that run blocking tier calls for the gRPC side (the event loop never does).
    workers: int = field(default=4, metadata=value_range(1, 256))
    # Batches of gRPC Get replies one tenant may have in flight on the one event loop every
    # tenant shares (kvtier.server.fair_gate): more overlaps a tenant's tier reads with its
    # sends, fewer keeps the other tenants' gRPC calls quick under its load
    # (bench/tenant_flood.py). The data path is not affected.
    grpc_get_turns_per_tenant: int = field(default=2, metadata=value_range(1, 256))
    # A gRPC Get whose client takes no reply for this long (it stopped reading, or hung with
    # no deadline) gives its tenant's turn back and goes on without it.
    grpc_send_stall_s: float = field(default=30.0, metadata=value_range(0.1, 3600))
    max_data_connections: int = field(default=256, metadata=value_range(1, 65536))
    # Data connections that have not authenticated yet: their own small cap (a new one pushes
    # out the oldest) and a hard deadline for TLS + HELLO, so no token-less peer holds slots.
    # Each data connection may hold shm_bytes of segment + max_chunk_bytes of scratch that no
    # quota counts: one tenant gets at most this many (0 = max_data_connections).
    max_data_connections_per_tenant: int = field(default=64, metadata=value_range(0, 65536))
    max_unauthenticated_connections: int = field(default=32, metadata=value_range(1, 4096))
    handshake_timeout_s: float = field(default=5.0, metadata=value_range(0.1, 600))
    # Shared-memory segment per data-path connection of a same-host client (0 = no shm path).
    # Reserved in /dev/shm (RAM) for the connection's life; chunks beyond it travel inline.
    shm_bytes: int = field(default=32 * MiB, metadata=value_range(0, 4 * GiB, size=True))
    # GET replies on shared memory name the chunk's place in the tenant's RAM arena, which the
    # client maps read-only, instead of copying it into the segment: one copy per chunk, not two
    # (kvtier.server.arena_refs). Arenas are then memfds; not with cpu.huge_pages.
    arena_reads: bool = True
    # SIGTERM: seconds in-flight RPCs get to finish before they are cancelled.
    grace_s: float = field(default=10.0, metadata=value_range(0, 3600))
    # Written (JSON: addresses and ports) once every listener is bound; for orchestration.
    ready_file: str = ""
    log_level: str = field(default="INFO", metadata={"choices": ("DEBUG", "INFO", "WARNING", "ERROR")})
    cpu: CpuTierConfig = field(default_factory=CpuTierConfig)
    disk: DiskTierConfig = field(default_factory=DiskTierConfig)
    # Lower tier under every tenant's RAM/disk (kvtier.server.lower): "redis" = the redis
    # section below (the library's RedisTierConfig; its ``enabled`` is not consulted).
    lower: str = field(default="none", metadata={"choices": ("none", "redis")})
    redis: RedisTierConfig = field(default_factory=RedisTierConfig)
    # Bound of the asynchronous write-through queue to the lower tier; Puts beyond it are
    # acknowledged from the node's tiers and dropped for the lower one (counted).
    lower_queue_bytes: int = field(default=256 * MiB, metadata=value_range(1 * MiB, None, size=True))
    # KV events for prefix-aware routers (kvtier.server.events; needs the ``events`` extra):
    # a ZMQ endpoint in vLLM's format, "" = off. ``tcp://*:5557`` binds, ``tcp://host:5557``
    # connects to a router's bound SUB socket.
    events_endpoint: str = ""
    events_topic: str = ""
    events_max_queue: int = field(default=100_000, metadata=value_range(1, None))

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def validate(self) -> None:
        """Cross-field rules the per-field metadata cannot express; raises ConfigError."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key")
        for name in ("tls_cert", "tls_key", "tls_client_ca", "tokens_file"):
            value = getattr(self, name)
            if value and not Path(value).expanduser().is_file():
                raise ConfigError(f"{name}: {value!r} is not a readable file")
        if self.max_chunk_bytes + MiB > self.max_message_bytes:
            raise ConfigError(
                f"max_chunk_bytes ({self.max_chunk_bytes}) must leave 1 MiB of headroom under "
                f"max_message_bytes ({self.max_message_bytes})")
        if self.port < 0:
            raise ConfigError("port: the gRPC listener cannot be disabled")
        if 0 < self.default_quota_bytes < MIN_QUOTA_BYTES:
            raise ConfigError(f"default_quota_bytes ({self.default_quota_bytes}) is under 1MiB, the smallest "
                              "tier a tenant gets (it could not be enforced); give 0 (none) or 1MiB or more")
        if self.events_endpoint:
            from kvtier.server.events import check_endpoint

            check_endpoint(self.events_endpoint)
        for peer in self.peers:
            try:
                parse_hostport(peer)
            except ValueError:
                raise ConfigError(f"peers: {peer!r} is not host:http_port") from None
        if not self.tls and not is_loopback(self.host) and not self.allow_insecure_remote:
            raise ConfigError(
                f"host {self.host!r} is not a loopback address and TLS is off: tokens and chunks "
                "would cross the network in clear. Give --tls-cert/--tls-key, or pass "
                "--allow-insecure-remote if the network is trusted")



def load_server_config(path: str | os.PathLike[str] | None = None,
                       overrides: Mapping[str, Any] | None = None,
                       env: Mapping[str, str] | None = None) -> ServerConfig:
    """defaults < YAML ``path`` < ``KVTIER_SERVER_*`` env < ``overrides`` (dotted or nested)."""
    merged: dict[str, Any] = {}
    if path:
        deep_merge(merged, read_yaml(Path(path)))
    deep_merge(merged, env_to_dict(os.environ if env is None else env, prefix=ENV_PREFIX))
    if overrides:
        deep_merge(merged, nest(overrides))
    cfg = from_dict(ServerConfig, merged)
    cfg.validate()
    return cfg


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"disk.path": x}`` -> ``{"disk": {"path": x}}``; nested mappings pass through."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out

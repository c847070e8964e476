"""How the grpc tier reaches a kvtier-server: bearer token, TLS (channel credentials and the
data path's SSL context, from the same files), channel options and which data path to use.
Configuration only: no connection is opened here (:mod:`kvtier.tiers.remote.node` opens them)."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import grpc

from kvtier.config import GrpcTierConfig
from kvtier.errors import TierUnavailableError
from kvtier.protocol.addresses import is_loopback
from kvtier.protocol.frames import WireLimits
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.tiers.remote.data_path import SocketDataPath


def read_token(cfg: GrpcTierConfig) -> str:
    if cfg.token:
        return cfg.token
    if cfg.token_file:
        try:
            return Path(cfg.token_file).expanduser().read_text().strip()
        except OSError as exc:
            raise TierUnavailableError(f"grpc tier: token_file {cfg.token_file}: {exc.strerror}") from exc
    return ""


def channel_credentials(cfg: GrpcTierConfig) -> grpc.ChannelCredentials | None:
    if not (cfg.tls or cfg.tls_ca):
        return None
    try:
        def read(p: str) -> bytes | None:
            return Path(p).expanduser().read_bytes() if p else None
        return grpc.ssl_channel_credentials(read(cfg.tls_ca), read(cfg.tls_key), read(cfg.tls_cert))
    except OSError as exc:
        raise TierUnavailableError(f"grpc tier: TLS file: {exc}") from exc



def client_ssl_context(cfg: GrpcTierConfig) -> ssl.SSLContext:
    """TLS for the data path, from the same files as the channel credentials."""
    try:
        ctx = ssl.create_default_context(cafile=os.path.expanduser(cfg.tls_ca) if cfg.tls_ca else None)
        if cfg.tls_cert:
            ctx.load_cert_chain(os.path.expanduser(cfg.tls_cert), os.path.expanduser(cfg.tls_key))
    except (OSError, ssl.SSLError) as exc:
        raise TierUnavailableError(f"grpc tier: TLS files: {exc}") from exc
    return ctx


def channel_options(cfg: GrpcTierConfig) -> list[tuple[str, Any]]:
    backoff_ms = int(min(cfg.backoff_s, cfg.backoff_max_s) * 1000)
    opts: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        # Chunks are MiBs: a 16 MiB stream window and large frames keep the pipe full.
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.max_frame_size", (1 << 24) - 1),
        ("grpc.http2.write_buffer_size", 8 << 20),
        # The tier does its own failover and backoff; grpc's reconnect backoff (up to 120 s by
        # default) would keep a restarted node unreachable long after it is back.
        ("grpc.enable_retries", 0),
        ("grpc.initial_reconnect_backoff_ms", max(backoff_ms, 50)),
        ("grpc.min_reconnect_backoff_ms", max(backoff_ms, 50)),
        ("grpc.max_reconnect_backoff_ms", max(int(cfg.backoff_max_s * 1000), 100)),
    ]
    if cfg.tls_server_name:
        opts.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
    return opts


def advertised_data_path(info: pb.InfoReply | None, cfg: GrpcTierConfig, host: str, token: str,
                         max_chunk_bytes: int) -> SocketDataPath | None:
    """The fastest data path ``cfg.data_path`` allows among those ``info`` advertised, not yet
    connected; None when chunk bytes are to use gRPC (none advertised, or ``data_path: grpc``)."""
    kinds = {e.kind: e for e in info.data_endpoints} if info else {}
    endpoint = kinds.get("socket")
    if cfg.data_path == "grpc" or endpoint is None or info is None:
        return None
    host = endpoint.address or host
    # Shared memory only towards this host: "auto" takes it for a loopback address, "shm"
    # asks for it whatever the address (a node reached by another name on this host).
    shm = "shm" in kinds and (cfg.data_path == "shm" or (cfg.data_path == "auto" and is_loopback(host)))
    tls = client_ssl_context(cfg) if endpoint.tls else None
    return SocketDataPath(host, endpoint.port, token, tls, cfg.tls_server_name or host,
                          WireLimits(max_chunk_bytes, info.max_batch_keys or 4096), cfg.connections, shm=shm)

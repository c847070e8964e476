"""Print the README's configuration table from kvtier.config (tests/test_readme.py keeps them equal).

    python scripts/config_reference.py
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterator

from kvtier.config import KVTierConfig

HELP = {
    "chunk_tokens": "tokens per cached chunk (a multiple of the engine's block size)",
    "hash": "chain hash; xxh3_128/blake3 only for single-tenant, trusted deployments",
    "key_schema": "v1: token chain per chunk; x1: SGLang's page chain, one chunk per page, shared by vLLM, transformers and SGLang (docs/keys.md)",
    "codec": "payload codec of stored chunks",
    "shuffle": "byte-shuffle fp16/bf16 payloads before compression",
    "tenant": "tenant label on metrics",
    "salt_hex": "namespace salt (hex); per-tenant isolation, see kvtier.keys.tenant_salt",
    "log_level": "log level of kvtier's loggers in connectors and the CLI",
    "metrics_label_values": "distinct tenants named on metrics before the rest read `other` (docs/metrics.md)",
    "cpu.enabled": "host-RAM arena tier",
    "cpu.capacity_bytes": "arena size",
    "cpu.slot_bytes": "fixed slot size: the largest chunk the arena holds",
    "cpu.policy": "eviction policy: dueling, adaptive, prefix, s3fifo, lfu or lru",
    "cpu.pin_memory": "pin the arena (only with CUDA present)",
    "cpu.huge_pages": "a lazily backed arena (kvtier-server) of 2 MiB-multiple slots on transparent huge pages",
    "cpu.warm_ahead_bytes": "kvtier-server: free RAM slots faulted in ahead of the puts that take them, within the RAM budget (0 = off)",
    "disk.enabled": "local SSD tier, one file per chunk; crash-safe: a killed process never leaves a torn chunk that is served; not fsynced, so power loss can lose recent puts",
    "disk.path": "directory of the disk tier (shared by processes on the host)",
    "disk.capacity_bytes": "bound on the files' total size",
    "disk.policy": "eviction policy: dueling, adaptive, prefix, s3fifo, lfu or lru",
    "disk.o_direct": "bypass the page cache where the filesystem allows",
    "disk.read_threads": "reads of one batch in flight at once (an SSD streams more at depth > 1; 1 = one at a time)",
    "redis.enabled": "Redis / Redis Cluster tier (docs/redis.md)",
    "redis.url": "redis://, rediss://, redis+cluster://h1:p1,h2:p2 …",
    "redis.key_prefix": "prefix of every Redis key",
    "redis.ttl_s": "expiry of stored chunks in seconds (0 = none)",
    "redis.timeout_s": "deadline of every Redis call",
    "redis.max_value_bytes": "chunks larger than this are refused before sending",
    "redis.username": "ACL user",
    "redis.password": "ACL password (prefer password_file)",
    "redis.password_file": "file holding the password",
    "redis.tls_ca": "CA bundle for rediss://",
    "redis.tls_cert": "client certificate (mutual TLS)",
    "redis.tls_key": "client key (mutual TLS)",
    "redis.tls_verify": "verify the server certificate",
    "redis.lazy_connect": "start even if Redis is unreachable (misses until it is up)",
    "redis.backoff_s": "first retry delay for a down node (at most `backoff_max_s`)",
    "redis.backoff_max_s": "largest retry delay for a down node",
    "grpc.enabled": "kvtier-server cluster tier (docs/server.md)",
    "grpc.nodes": "host:port of each kvtier-server",
    "grpc.replication": "copies of each chunk (consistent-hash ring, docs/placement.md)",
    "grpc.timeout_s": "deadline of every call",
    "grpc.token": "bearer token (prefer token_file)",
    "grpc.token_file": "file holding the bearer token",
    "grpc.tls": "use TLS to the servers",
    "grpc.tls_ca": "CA bundle",
    "grpc.tls_cert": "client certificate (mutual TLS)",
    "grpc.tls_key": "client key (mutual TLS)",
    "grpc.tls_server_name": "override the TLS server name",
    "grpc.data_path": "bulk bytes path; auto is a fixed order, not a measurement: shm to a loopback address, else socket, else grpc",
    "grpc.backoff_s": "first retry delay for a down node (at most `backoff_max_s`)",
    "grpc.backoff_max_s": "largest retry delay for a down node",
    "grpc.max_message_bytes": "gRPC message size limit",
    "grpc.connections": "bulk data-path connections per node",
    "grpc.group_chunks": "consecutive chunks of a prefix placed on the same nodes (G)",
    "grpc.discovery": "dns:HOST:PORT (A/AAAA) or srv:NAME; overrides nodes, re-resolved",
    "grpc.resolve_interval_s": "seconds between two resolutions of discovery",
    "grpc.idle_close_s": "a node's connections close after this long unused",
    "grpc.hedge_after": "fraction of timeout_s after which a read also asks the next replica (0: off)",
    "store.write_policy": "write_through, write_through_selective (after N hits), write_back (on eviction)",
    "store.selective_min_hits": "hits before write_through_selective writes a chunk down",
    "store.queue_depth": "write-behind batches queued before writes are dropped",
    "store.promote_on_load": "copy chunks served by a lower tier into the tiers above",
    "usage.enabled": "connectors send usage reports to the grpc nodes (the /dashboard's engine figures)",
    "usage.interval_s": "seconds between two usage reports (cumulative counters)",
    "usage.replica_id": "this engine replica's name in reports (empty: host-pid, or the engine's id)",
}


def rows(cls: type = KVTierConfig, prefix: str = "") -> Iterator[str]:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            yield from rows(tp, prefix + f.name + ".")
            continue
        meta = f.metadata
        if "choices" in meta:
            allowed = ", ".join(meta["choices"])
        elif "range" in meta:
            lo, hi = meta["range"]
            allowed = f"{lo} … {hi if hi is not None else '∞'}"
        else:
            allowed = ""
        name = prefix + f.name
        yield f"| `{name}` | `{f.default!r}` | {allowed} | {HELP[name]} |"


def table() -> str:
    head = "| field | default | allowed | meaning |\n|---|---|---|---|\n"
    return head + "\n".join(rows()) + "\n"


if __name__ == "__main__":
    print(table(), end="")

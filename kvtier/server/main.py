"""``kvtier-server``: command-line entry point (console script ``kvtier.server.main:main``).

Settings come from (lowest first) defaults < ``--config`` YAML < ``KVTIER_SERVER_*``
environment < flags; ``--print-config`` shows the result. Exit status: 0 after a clean stop
(SIGTERM/SIGINT), 2 for a configuration error, 1 when a listener cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys
from typing import Any

from kvtier.errors import ConfigError, KVTierError

EPILOG = """\
examples:
  kvtier-server                                   RAM only, loopback, ports 50051 (gRPC),
                                                  50052 (HTTP: /metrics /healthz /api/stats
                                                  /api/cluster /dashboard),
                                                  50053 (bulk data path)
  kvtier-server --disk-dir /mnt/nvme/kvtier --disk-bytes 200GiB --cpu-bytes 16GiB
                                                  chunks survive restarts (kill -9 included)
  kvtier-server --lower redis --redis-url redis+cluster://10.0.0.7:6379,10.0.0.8:6379
                                                  node-local cache over a Redis Cluster shared
                                                  by every node (Puts written through, misses
                                                  read from the cluster; docs: deploy/README.md)
  kvtier-server --node-id a --peers 10.0.0.2:50052,10.0.0.3:50052
                                                  /dashboard shows this node and its peers
  kvtier-server --host 0.0.0.0 --tls-cert node.pem --tls-key node.key \\
      --tokens-file /etc/kvtier/tokens            remote clients, TLS, one namespace per tenant

tokens file (one line per token, '#' comments):
  <token> <tenant> [<quota, e.g. 50GiB>] [admin]

environment: KVTIER_SERVER_<SETTING>, sections with '__', e.g. KVTIER_SERVER_PORT=7000,
  KVTIER_SERVER_DISK__PATH=/data/kvtier. YAML (--config) uses the same names:
  port: 7000
  disk: {enabled: true, path: /data/kvtier, capacity_bytes: 200GiB}
Ports: 0 picks a free port (see the log line or --ready-file), -1 disables HTTP / data path.
Full reference: docs/server.md
"""

# flag -> dotted setting; a flag given on the command line overrides file and environment.
_FLAGS: dict[str, tuple[str, str]] = {
    "host": ("host", ("address to listen on (default 127.0.0.1; non-loopback needs TLS or "
                      "--allow-insecure-remote)")),
    "port": ("port", "gRPC port (default 50051; 0 = any free port)"),
    "http_port": ("http_port", "HTTP side port for /metrics /healthz /api/stats (default 50052; -1 = off)"),
    "data_port": ("data_port", "bulk data-path port (default 50053; -1 = off, gRPC carries the bytes)"),
    "cpu_bytes": ("cpu.capacity_bytes", "RAM for chunks, all tenants together (default 1GiB)"),
    "slot_bytes": ("cpu.slot_bytes", "RAM slot size = largest chunk kept in RAM (default 4MiB)"),
    "disk_dir": ("disk.path", "keep chunks on disk under this directory (enables the disk tier)"),
    "disk_bytes": ("disk.capacity_bytes", "disk budget, all tenants together (default 16GiB)"),
    "lower": ("lower", "tier under RAM/disk shared by every node: none (default) or redis"),
    "redis_url": ("redis.url", "with --lower redis: redis://h:p/0 or redis+cluster://h1:p1,h2:p2"),
    "tokens_file": ("tokens_file", "bearer tokens -> tenants (enables auth); format below"),
    "default_quota": ("default_quota_bytes", "quota of tenants whose token line names none"),
    "tls_cert": ("tls_cert", "PEM certificate chain (enables TLS on gRPC and the data path)"),
    "tls_key": ("tls_key", "PEM private key of --tls-cert"),
    "tls_client_ca": ("tls_client_ca", "PEM CA bundle; clients must present a certificate it signed (mTLS)"),
    "node_id": ("node_id", "name of this node in stats (default host:pid)"),
    "peers": ("peers", "other servers' host:http_port, comma-separated, for /dashboard and /api/cluster"),
    "ready_file": ("ready_file", "write JSON with the bound ports here once serving"),
    "log_level": ("log_level", "DEBUG, INFO (default), WARNING or ERROR"),
    "grace": ("grace_s", "seconds in-flight requests get to finish on SIGTERM (default 10)"),
    "events_endpoint": ("events_endpoint", "publish KV events for routers (vLLM's ZMQ format), e.g. tcp://*:5557"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier-server", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="kvtier cache node: stores KV-cache chunks for kvtier clients (the grpc tier).")
    p.add_argument("--config", metavar="FILE", help="YAML settings file")
    for name, (_, help_text) in _FLAGS.items():
        p.add_argument("--" + name.replace("_", "-"), dest=name, metavar="VALUE", help=help_text)
    p.add_argument("--allow-insecure-remote", action="store_true", default=None,
                   help="allow plain-text listeners on a non-loopback address (trusted networks only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other setting, dotted (e.g. --set max_batch_keys=1024 --set cpu.policy=lru)")
    p.add_argument("--print-config", action="store_true", help="print the effective settings as JSON and exit")
    return p


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (setting, _) in _FLAGS.items():
        value = getattr(args, name)
        if value is not None:
            out[setting] = value
    if args.disk_dir is not None:
        out["disk.enabled"] = True
    if args.allow_insecure_remote:
        out["allow_insecure_remote"] = True
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imported after parsing so that --help stays instant and works without grpc installed.
    from kvtier.server.config import load_server_config

    try:
        cfg = load_server_config(args.config, overrides_from_args(args))
    except (ConfigError, OSError) as exc:
        print(f"kvtier-server: error: {exc}", file=sys.stderr)
        return 2
    if args.redis_url is not None and cfg.lower != "redis":  # a flag that would do nothing
        print(f"kvtier-server: error: --redis-url is given but lower is {cfg.lower!r}: add --lower redis",
              file=sys.stderr)
        return 2
    if args.print_config:
        print(json.dumps(dataclasses.asdict(cfg), indent=1))
        return 0
    logging.basicConfig(level=cfg.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvtier.server.app import serve

    try:
        return asyncio.run(serve(cfg))
    except (RuntimeError, OSError, KVTierError) as exc:
        # grpc raises RuntimeError("Failed to bind ...") for a busy port; OSError for HTTP/data.
        logging.getLogger("kvtier.server").error("cannot start: %s", exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())

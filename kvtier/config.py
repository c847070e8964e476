"""One typed configuration: frozen dataclasses, loaded from YAML, environment or a plain dict.

Precedence (lowest first): defaults < YAML file < ``KVTIER_*`` environment < explicit dict.
Environment names are ``KVTIER_<FIELD>`` for top-level fields and ``KVTIER_<SECTION>__<FIELD>``
for sections, e.g. ``KVTIER_DISK__PATH=/mnt/nvme/kvtier``, ``KVTIER_CPU__CAPACITY_BYTES=8GiB``.
A ``KVTIER_*`` name that is neither a field nor a section is not a library setting and is
ignored (kvtier-server's ``KVTIER_SERVER_*``, tools' and tests' variables), with a warning
where it looks like a misspelt setting (``KVTIER_DISK_PATH``); inside a known section an
unknown field is an error, as in YAML. Sources are read by kvtier.config_sources.
Sizes accept plain integers or suffixed strings (``512MiB``, ``4GiB``, ``1.5GB``); tuples
accept YAML lists or comma-separated strings. Every invalid value raises
:class:`kvtier.errors.ConfigError` naming the field and what it allows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config_sources import deep_merge, env_suggestion, env_to_dict, parse_size, read_yaml
from kvtier.errors import ConfigError
from kvtier.policies import DEFAULT_POLICY
from kvtier.protocol.addresses import parse_hostport

GiB = 1 << 30
MiB = 1 << 20

log = logging.getLogger(__name__)


def value_range(lo: float | None = None, hi: float | None = None, *, size: bool = False) -> dict[str, Any]:
    return {"range": (lo, hi), "size": size}


def one_of(*choices: str) -> dict[str, Any]:
    return {"choices": choices}


@dataclass(frozen=True)
class CpuTierConfig:
    """Host-RAM arena of fixed-size slots (pinned when CUDA is present)."""

    enabled: bool = True
    capacity_bytes: int = field(default=1 * GiB, metadata=value_range(1 * MiB, None, size=True))
    slot_bytes: int = field(default=4 * MiB, metadata=value_range(4096, 1 * GiB, size=True))
    policy: str = DEFAULT_POLICY
    pin_memory: str = field(default="auto", metadata=one_of("auto", "always", "never"))
    # A lazily backed arena (kvtier-server's) of 2 MiB-multiple slots on transparent huge
    # pages: a put into fresh memory faults 2 MiB at a time (bench/cpu_lazy.py), but resident
    # memory is rounded up to 2 MiB per chunk. The library's pre-touched arena ignores it.
    huge_pages: bool = False
    # kvtier-server: free slots of its lazy arenas kept faulted in ahead of the puts that take
    # them, by a background thread (kvtier.server.warm_ahead); 0 = off. Resident memory, within
    # the RAM budget. The library's pre-touched arena ignores it.
    warm_ahead_bytes: int = field(default=256 * MiB, metadata=value_range(0, None, size=True))


@dataclass(frozen=True)
class DiskTierConfig:
    """Local SSD: one file per chunk, bounded footprint, rebuilt from headers at start."""

    enabled: bool = False
    path: str = "~/.cache/kvtier/disk"
    capacity_bytes: int = field(default=16 * GiB, metadata=value_range(1 * MiB, None, size=True))
    policy: str = DEFAULT_POLICY
    o_direct: bool = True
    read_threads: int = field(default=4, metadata=value_range(1, 16))


@dataclass(frozen=True)
class RedisTierConfig:
    """Redis or Redis Cluster (``redis+cluster://h1:p1,h2:p2``); see docs/redis.md."""

    enabled: bool = False
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvtier"
    ttl_s: int = field(default=0, metadata=value_range(0, None))
    timeout_s: float = field(default=1.0, metadata=value_range(0.001, 600))
    max_value_bytes: int = field(default=64 * MiB, metadata=value_range(1024, 512 * MiB, size=True))
    # ACL credentials; when set they override the user/password given in ``url``.
    username: str = ""
    password: str = ""
    password_file: str = ""
    # TLS (rediss:// and rediss+cluster://): CA bundle, optional client cert/key for mTLS.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_verify: bool = True
    # False: an unreachable Redis at start raises TierUnavailableError; True: start anyway,
    # serve misses, and connect when it comes up.
    lazy_connect: bool = False
    # A node that fails is skipped (instant node_down misses) and re-pinged in the
    # background after backoff_s, doubling up to backoff_max_s while it stays down.
    backoff_s: float = field(default=0.5, metadata=value_range(0.01, 600))
    backoff_max_s: float = field(default=10.0, metadata=value_range(0.01, 3600))

    def __post_init__(self) -> None:
        _at_most("redis", "backoff_s", self.backoff_s, "backoff_max_s", self.backoff_max_s)


@dataclass(frozen=True)
class GrpcTierConfig:
    """Client of kvtier-server nodes (``host:port`` each); see docs/server.md.

    Chunks go to ``replication`` nodes on a consistent-hash ring (docs/placement.md), G =
    ``group_chunks`` consecutive chunks of a prefix together; every verb finishes within
    ``timeout_s``; a failing node is skipped (its chunks miss with reason ``node_down``) and
    probed again after ``backoff_s``, doubling up to ``backoff_max_s``. TLS is on when ``tls``
    or ``tls_ca`` is set (``tls_cert``/``tls_key``: client certificate for mutual TLS).
    ``data_path``: how chunk bytes travel; ``auto`` takes the fastest the node advertises:
    ``shm`` (a shared-memory segment, nodes on this host), else ``socket`` (length-prefixed
    frames on the node's data port), else ``grpc``; a failing fast path falls back to gRPC.
    Nodes come from ``nodes`` or, when set, ``discovery`` (``dns:HOST:PORT`` or ``srv:NAME``),
    resolved again every ``resolve_interval_s``; connections open on first use and close after
    ``idle_close_s`` unused. A read whose node has not answered after ``hedge_after`` x
    ``timeout_s`` also asks the next replica (0: never).
    """

    enabled: bool = False
    nodes: tuple[str, ...] = ()
    replication: int = field(default=1, metadata=value_range(1, 16))
    timeout_s: float = field(default=2.0, metadata=value_range(0.001, 600))
    token: str = ""
    token_file: str = ""
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""
    data_path: str = field(default="auto", metadata=one_of("auto", "shm", "socket", "grpc"))
    backoff_s: float = field(default=0.25, metadata=value_range(0.001, 60))
    backoff_max_s: float = field(default=10.0, metadata=value_range(0.01, 3600))
    max_message_bytes: int = field(default=64 * MiB, metadata=value_range(1 * MiB, 1 * GiB, size=True))
    connections: int = field(default=4, metadata=value_range(1, 256))
    group_chunks: int = field(default=8, metadata=value_range(1, 4096))
    discovery: str = ""
    resolve_interval_s: float = field(default=10.0, metadata=value_range(0.05, 3600))
    idle_close_s: float = field(default=60.0, metadata=value_range(0.01, 86400))
    hedge_after: float = field(default=0.5, metadata=value_range(0.0, 1.0))

    def __post_init__(self) -> None:
        _at_most("grpc", "backoff_s", self.backoff_s, "backoff_max_s", self.backoff_max_s)
        kind, sep, rest = self.discovery.partition(":")
        if self.discovery and (kind not in ("dns", "srv") or not sep or not rest):
            raise ConfigError(f"grpc.discovery: {self.discovery!r}: expected dns:HOST:PORT or srv:NAME")
        for i, node in enumerate(self.nodes):
            if not _is_hostport(node):
                raise ConfigError(f"grpc.nodes[{i}]: {node!r} is not HOST:PORT with a port in 1-65535 "
                                  f"(e.g. 10.0.0.5:50051, [::1]:50051)")


def _at_most(section: str, lo_name: str, lo: float, hi_name: str, hi: float) -> None:
    """The cross-field rule ``lo <= hi``, checked when the config is read, not at tier open."""
    if lo > hi:
        raise ConfigError(f"{section}.{lo_name} ({lo}) must not exceed {section}.{hi_name} ({hi})")


def _is_hostport(node: object) -> bool:
    if not isinstance(node, str):
        return False
    try:
        parse_hostport(node)
    except ValueError:
        return False
    # parse_hostport takes any text before the last colon as the host: a URL (http://h:50051)
    # or a bare IPv6 address (::1:50051) would reach gRPC as a target it misreads.
    host = node.rpartition(":")[0]
    bracketed = host.startswith("[") and host.endswith("]")
    return not ("/" in host or any(c.isspace() for c in host) or (":" in host and not bracketed))


@dataclass(frozen=True)
class StoreConfig:
    write_policy: str = field(
        default="write_through",
        metadata=one_of("write_through", "write_through_selective", "write_back"),
    )
    selective_min_hits: int = field(default=2, metadata=value_range(1, 1_000_000))
    queue_depth: int = field(default=256, metadata=value_range(1, 1_000_000))
    promote_on_load: bool = True


@dataclass(frozen=True)
class UsageConfig:
    """Engine usage reports (kvtier.usage): every ``interval_s`` a connector sends its
    cumulative counters to each node in ``grpc.nodes`` under ``replica_id`` (empty: host-pid,
    or the engine's own id where it has one). Off when ``enabled`` is false or no grpc tier."""

    enabled: bool = True
    interval_s: float = field(default=5.0, metadata=value_range(0.05, 3600))
    replica_id: str = ""


@dataclass(frozen=True)
class KVTierConfig:
    chunk_tokens: int = field(default=256, metadata=value_range(1, 1 << 20))
    hash: str = field(default="sha256", metadata=one_of("sha256", "xxh3_128", "blake3"))
    # v1: kvtier's token chain per chunk; x1: the cross-engine page chain SGLang computes
    # (docs/keys.md "Key schemas"), so vLLM, transformers and SGLang share chunks.
    key_schema: str = field(default="v1", metadata=one_of("v1", "x1"))
    codec: str = field(default="raw", metadata=one_of("raw", "lz4", "zstd"))
    shuffle: bool = False
    tenant: str = ""
    salt_hex: str = ""
    log_level: str = field(default="WARNING", metadata=one_of("DEBUG", "INFO", "WARNING", "ERROR"))
    # Distinct tenant names the metrics keep before the rest read "other" (docs/metrics.md).
    metrics_label_values: int = field(default=64, metadata=value_range(0, 100_000))
    cpu: CpuTierConfig = CpuTierConfig()
    disk: DiskTierConfig = DiskTierConfig()
    redis: RedisTierConfig = RedisTierConfig()
    grpc: GrpcTierConfig = GrpcTierConfig()
    store: StoreConfig = StoreConfig()
    usage: UsageConfig = UsageConfig()

    def __post_init__(self) -> None:
        try:
            bytes.fromhex(self.salt_hex)
        except ValueError:
            raise ConfigError(f"salt_hex: {self.salt_hex!r} is not a hex string") from None
        if self.key_schema == "x1" and self.hash != "sha256":
            raise ConfigError(f"hash: key_schema x1 keys pages by SGLang's SHA-256 page chain inside a "
                              f"SHA-256 namespace; hash {self.hash!r} would name another namespace "
                              f"(use hash sha256 with x1)")

    @property
    def salt(self) -> bytes:
        """Namespace salt (per-tenant isolation); see kvtier.keys.tenant_salt."""
        return bytes.fromhex(self.salt_hex)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None,
             overrides: Mapping[str, Any] | None = None,
             env: Mapping[str, str] | None = None) -> KVTierConfig:
        """defaults < YAML ``path`` < environment (``os.environ`` unless given) < ``overrides``."""
        merged: dict[str, Any] = {}
        if path is not None:
            deep_merge(merged, read_yaml(Path(path)))
        environ = os.environ if env is None else env
        from_env = env_to_dict(environ)
        known = {f.name for f in dataclasses.fields(cls)}
        for name in sorted(set(from_env) - known):
            del from_env[name]
        for var in sorted(v for v in environ if v.startswith("KVTIER_")):
            rest = var[len("KVTIER_"):].lower()
            if rest.split("__")[0] in known:
                continue
            # KVTIER_SERVER_* is kvtier-server's namespace; other KVTIER_* names belong to
            # tools and tests (KVTIER_TRACE, KVTIER_SGLANG_VENV, ...): not library settings,
            # so not an error; but a near miss of a setting would silently do nothing.
            guess = env_suggestion(cls, rest)
            if guess:
                log.warning("ignoring %s: not a kvtier setting; did you mean %s?", var, guess)
            else:
                log.debug("ignoring %s: not a kvtier library setting", var)
        deep_merge(merged, from_env)
        if overrides:
            deep_merge(merged, dict(overrides))
        return from_dict(cls, merged)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVTierConfig:
        return from_dict(cls, data)


def _coerce(f: dataclasses.Field[Any], tp: Any, value: Any, where: str) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, prefix=where + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        # bool is an int, and YAML reads yes/no/on/off as booleans: refuse `chunk_tokens: yes`
        # rather than take it as 1.
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if f.metadata.get("size"):
            return parse_size(value, where)
        try:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        try:
            if isinstance(value, bool):
                raise ValueError
            number = float(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond a float
            raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        # NaN compares false with both ends of a range, so it would pass _validate.
        if not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if typing.get_origin(tp) is tuple:
        if isinstance(value, str):
            items: list[Any] = value.split(",")
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise ConfigError(f"{where}: expected a list or a comma-separated string, got {value!r}")
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise ConfigError(f"{where}[{i}]: expected a string, got {item!r}")
        return tuple(i.strip() for i in items if i.strip())
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def _validate(f: dataclasses.Field[Any], value: Any, where: str) -> None:
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}: {value!r} is not allowed; expected one of {', '.join(choices)}")
    lo, hi = f.metadata.get("range", (None, None))
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        shown = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ConfigError(f"{where}: {value!r} is out of range {shown}")


T = typing.TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a (nested) mapping; unknown keys are errors, not ignored."""
    assert dataclasses.is_dataclass(cls)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    # key=str: YAML 1.1 reads keys such as `on:` or `1:` as bool/int, which do not sort with str.
    unknown = sorted(set(data) - set(fields), key=str)
    if unknown:
        hint = " (YAML reads an unquoted on/off/yes/no key as a boolean)" if isinstance(unknown[0], bool) else ""
        raise ConfigError(f"{prefix}{unknown[0]}: unknown setting{hint}; known: {', '.join(sorted(fields))}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        where = prefix + name
        if name in data:
            tp = hints[name]
            if isinstance(tp, types.UnionType):
                tp = next(a for a in typing.get_args(tp) if a is not type(None))
            kwargs[name] = _coerce(f, tp, data[name], where)
            _validate(f, kwargs[name], where)
        elif f.default is not dataclasses.MISSING:
            _validate(f, f.default, where)
    return cls(**kwargs)

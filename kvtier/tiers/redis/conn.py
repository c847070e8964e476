"""Redis URLs and redis-py client construction for the redis tier.

URL forms (credentials percent-encoded; ``db`` only for single nodes)::

    redis://[user[:password]@]host[:port][/db]
    rediss://...                                   TLS
    redis+cluster://[user[:password]@]h1:p1,h2:p2  Redis Cluster (any subset of nodes)
    rediss+cluster://...                           Redis Cluster over TLS

Large values: commands are packed by redis-py's Python packer (no copy of MiB-sized values,
see ``_construct_command_packer``) and replies read in 1 MiB steps.

Clients are built so that no call can wait longer than it should: one ``timeout_s`` for the
connect and for every socket read, and no redis-py retries (``Retry(NoBackoff(), 0)``) at
any level, since each retry would multiply the deadline. Every connection goes through a
*guarded* connection class that (a) refuses at once to connect to a node the tier has marked
down, so that no code path (ours or redis-py's cluster topology refresh) waits on a dead
node twice, and (b) reports a failed connect to :class:`NodeHealth` with the exact node.
"""

from __future__ import annotations

import errno
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, ConnectionPool, PythonRespSerializer, SSLConnection
from redis.retry import Retry

from kvtier.codec import Buf
from kvtier.config import RedisTierConfig
from kvtier.errors import ConfigError, TierUnavailableError
from kvtier.tiers.redis.health import F_AUTH, MEDIUM_ERRORS, NodeHealth, classify

DEFAULT_PORT = 6379
# Bytes per recv(): redis-py's 64 KiB default costs 16 syscalls and 16 parser feeds per MiB;
# chunks are ~1 MiB, so read in 1 MiB steps (the buffer is per connection, not per call).
SOCKET_READ_SIZE = 1 << 20
_SCHEMES = {"redis": (False, False), "rediss": (False, True),
            "redis+cluster": (True, False), "rediss+cluster": (True, True)}


@dataclass(frozen=True)
class RedisTarget:
    """What a URL names: one node or a cluster's seed nodes, TLS or not, credentials, db."""

    cluster: bool
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    username: str = ""
    password: str = ""
    db: int = 0

    @property
    def node_names(self) -> list[str]:
        return [node_name(h, p) for h, p in self.nodes]

    @property
    def display(self) -> str:
        """The URL without its password (for messages and logs)."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        user = f"{self.username}@" if self.username else ""
        db = "" if self.cluster else f"/{self.db}"
        return f"{scheme}://{user}{','.join(self.node_names)}{db}"


def node_name(host: str, port: int) -> str:
    """redis-py's node naming (``host:port``), used as the key of all per-node state."""
    return f"{host}:{port}"


def _parse_host(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [v6::addr]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise ConfigError(f"redis.url: empty host in {url!r}")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"redis.url: bad port {port_text!r} in {url!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"redis.url: port {port} out of range in {url!r}")
    return host, port


def parse_url(url: str) -> RedisTarget:
    """Parse a tier URL (see module docstring); raise ConfigError naming what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in _SCHEMES:
        raise ConfigError(f"redis.url: {url!r} must start with one of "
                          f"{', '.join(s + '://' for s in _SCHEMES)}")
    cluster, tls = _SCHEMES[scheme.lower()]
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        userinfo, hostpart = "", rest
    hostpart, _, query = hostpart.partition("?")
    if query:
        raise ConfigError(f"redis.url: query options ({query!r}) are not supported; use the "
                          "redis.* settings (tls_ca, username, ...) instead")
    hosts_text, _, path = hostpart.partition("/")
    user, _, password = userinfo.partition(":")
    nodes = tuple(_parse_host(h.strip(), url) for h in hosts_text.split(",") if h.strip())
    if not nodes:
        raise ConfigError(f"redis.url: no host in {url!r}")
    if len(nodes) > 1 and not cluster:
        raise ConfigError(f"redis.url: several hosts need the redis+cluster:// scheme: {url!r}")
    db = 0
    if path.strip("/"):
        try:
            db = int(path.strip("/"))
        except ValueError:
            raise ConfigError(f"redis.url: database {path!r} is not a number in {url!r}") from None
    if cluster and db != 0:
        raise ConfigError(f"redis.url: Redis Cluster has only database 0, got {db} in {url!r}")
    return RedisTarget(cluster, tls, nodes, unquote(user), unquote(password), db)


def resolve_target(cfg: RedisTierConfig) -> RedisTarget:
    """The URL's target with config credentials applied (config wins over the URL)."""
    t = parse_url(cfg.url)
    password = t.password
    if cfg.password_file:
        try:
            password = Path(cfg.password_file).expanduser().read_text().strip()
        except OSError as exc:
            raise ConfigError(f"redis.password_file: cannot read {cfg.password_file}: "
                              f"{exc.strerror}") from exc
    if cfg.password:
        password = cfg.password
    for setting in ("tls_ca", "tls_cert", "tls_key"):
        path = getattr(cfg, setting)
        if t.tls and path and not os.access(path, os.R_OK):
            raise ConfigError(f"redis.{setting}: cannot read {path!r} (missing, or not readable "
                              "by this process)")
    return RedisTarget(t.cluster, t.tls, t.nodes, cfg.username or t.username, password, t.db)


def _construct_command_packer(self: Connection, packer: Any) -> Any:
    """redis-py's default packer with hiredis installed copies every argument of a command
    into one ``bytes`` (measured ~4x slower than needed for an 8 x 1 MiB MSET); its Python
    packer hands values over the buffer cutoff to ``sendall`` as they are, with no copy."""
    if packer is not None:
        return packer
    return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)  # type: ignore[attr-defined]


def guarded_connection_class(tls: bool, health: NodeHealth) -> type[Connection]:
    """A per-tier subclass of redis-py's (SSL)Connection whose socket connect consults and
    feeds ``health`` (see module docstring) and whose packer sends large values without
    copying them."""
    base: type[Connection] = SSLConnection if tls else Connection

    def _connect(self: Connection) -> socket.socket:
        name = node_name(self.host, self.port)
        if not health.gate_open(name):
            raise ConnectionRefusedError(errno.ECONNREFUSED, "node is down (kvtier backoff)")
        try:
            return super(cls, self)._connect()  # type: ignore[safe-super]
        except OSError as exc:  # socket.timeout and ssl.SSLError are OSErrors
            health.failed(name, f"connect failed: {exc!r}")
            raise

    def on_connect(self: Connection) -> None:
        try:
            super(cls, self).on_connect()  # type: ignore[safe-super]
        except MEDIUM_ERRORS as exc:  # the handshake (AUTH, ACL) refused: back this node off
            if classify(exc).label == F_AUTH:  # so other nodes' commands still go out
                health.failed(node_name(self.host, self.port), f"handshake refused: {exc!r}")
            raise

    cls: type[Connection] = type("KVTierGuarded" + base.__name__, (base,), {
        "_connect": _connect, "on_connect": on_connect,
        "_construct_command_packer": _construct_command_packer})
    return cls


def _connection_kwargs(cfg: RedisTierConfig, target: RedisTarget,
                       health: NodeHealth) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "connection_class": guarded_connection_class(target.tls, health),
        "socket_timeout": cfg.timeout_s,
        "socket_connect_timeout": cfg.timeout_s,
        "socket_keepalive": True,
        "socket_read_size": SOCKET_READ_SIZE,
        "username": target.username or None,
        "password": target.password or None,
        # No client_name: CLIENT SETNAME needs an ACL permission of its own, and a
        # least-privilege user (the commands in docs/redis.md) could not connect at all.
    }
    if target.tls:
        kw.update({
            "ssl_ca_certs": cfg.tls_ca or None,
            "ssl_certfile": cfg.tls_cert or None,
            "ssl_keyfile": cfg.tls_key or None,
            "ssl_cert_reqs": "required" if cfg.tls_verify else "none",
            "ssl_check_hostname": cfg.tls_verify,
        })
    return kw


def build_single(cfg: RedisTierConfig, target: RedisTarget, health: NodeHealth) -> redis.Redis:
    """A client of one node. Builds no connection yet (the pool connects on first use)."""
    host, port = target.nodes[0]
    pool = ConnectionPool(host=host, port=port, db=target.db, retry=Retry(NoBackoff(), 0),
                          **_connection_kwargs(cfg, target, health))
    return redis.Redis(connection_pool=pool)


def build_cluster(cfg: RedisTierConfig, target: RedisTarget, health: NodeHealth) -> RedisCluster:
    """A Redis Cluster client; connects to a seed node to learn the slot map (may raise
    redis-py errors). redis-py takes per-node connection settings only through its
    ``url=`` constructor path, hence the plain ``redis://`` URL of the first seed (TLS comes
    from the guarded SSL connection class, not from the URL scheme)."""
    (h0, p0), *rest = target.nodes
    host0 = f"[{h0}]" if ":" in h0 else h0
    return RedisCluster(url=f"redis://{host0}:{p0}",
                        startup_nodes=[ClusterNode(h, p) for h, p in rest],
                        retry=Retry(NoBackoff(), 0), require_full_coverage=False,
                        **_connection_kwargs(cfg, target, health))


def as_value(data: Buf) -> Buf:
    """A bytes-like redis-py can send: bytes/bytearray as they are, memoryviews as flat
    byte views (no copy unless the view is not contiguous)."""
    if isinstance(data, memoryview):
        if not data.c_contiguous:
            return data.tobytes()
        if data.format != "B" or data.ndim != 1:
            return data.cast("B")
    return data


def misconfiguration(exc: BaseException, target: RedisTarget,
                     tier: str) -> TierUnavailableError | None:
    """The start-up error to raise when ``exc`` (or what caused it: redis-py's cluster client
    wraps the first node's error) says that credentials or TLS are wrong; None otherwise."""
    text = str(exc)
    chain: list[BaseException] = [exc]
    while len(chain) < 8 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    if any(classify(e).label == F_AUTH for e in chain) or any(
            s in text for s in ("WRONGPASS", "NOAUTH", "NOPERM", "invalid username")):
        return TierUnavailableError(
            f"redis tier {tier!r}: {target.display} rejected the credentials ({text}); "
            "check redis.username / redis.password / the URL")
    if target.tls and (any(isinstance(e, redis.exceptions.TimeoutError) for e in chain)
                       or any(s in text for s in ("SSL", "certificate", "EOF", "handshake"))):
        return TierUnavailableError(
            f"redis tier {tier!r}: TLS handshake with {target.display} failed ({text}); is that "
            "port a TLS port (tls-port), and does redis.tls_ca hold the CA that signed the "
            "server certificate?")
    return None

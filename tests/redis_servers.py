"""Real redis-server processes for tests and benches: single nodes and a 3-master cluster.

Every server runs on a free loopback port, in its own temp directory, with persistence off
(``--save "" --appendonly no``) so that tests never touch the system Redis on 6379 and never
leave state behind. Helpers here start, kill (SIGKILL), restart and stop servers; the pytest
fixtures live in the test modules (module scope) so each file pays the start-up cost once.

Used by tests/test_redis_tier.py, tests/test_redis_cluster.py and bench/remote_redis.py
(which puts this directory on ``sys.path``), so it imports nothing from pytest.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from kvtier.config import RedisTierConfig
from kvtier.tiers.redis import RedisTier

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"
# util-linux's setpriv makes the server die with the process that started it (PDEATHSIG), so a
# test run killed by a timeout leaves no redis-server behind (no preexec_fn: tests use threads).
_SETPRIV = shutil.which("setpriv")
_DIE_WITH_PARENT = [_SETPRIV, "--pdeathsig", "KILL"] if _SETPRIV else []


def have_redis() -> bool:
    return os.access(REDIS_SERVER, os.X_OK) and os.access(REDIS_CLI, os.X_OK)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections take ports there)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_CLUSTER_BUS_OFFSET = 10000
_PORT_LOW = 12000
# Every port handed out, and a cluster node's bus port (port + 10000), lies below the ephemeral
# range: there, no outgoing connection of this or another test can take the port between the
# free-check and the server's bind (a bus port at 33960 once lost that race in CI).
_PORT_HIGH = max(_PORT_LOW + 2000, _ephemeral_low() - _CLUSTER_BUS_OFFSET)
_next_port = [_PORT_LOW + (os.getpid() * 37) % (_PORT_HIGH - _PORT_LOW)]


def free_port(cluster_bus: bool = False) -> int:
    """A loopback port that is free now (and, for cluster nodes, whose bus port +10000 is too).

    Ports come from a per-process moving window below the kernel's ephemeral range, so no
    client socket is given one by the kernel, and two test processes rarely race for the
    same port."""
    span = _PORT_HIGH - _PORT_LOW
    for _ in range(span):
        port = _next_port[0]
        _next_port[0] = _PORT_LOW + (port - _PORT_LOW + 1) % span
        if port == 6379 or not _port_free(port):
            continue
        if cluster_bus and not _port_free(port + _CLUSTER_BUS_OFFSET):
            continue
        return port
    raise RuntimeError("no free loopback port found")


@dataclass
class RedisServer:
    """One redis-server process. ``args`` are extra ``--name value`` settings."""

    port: int = 0
    args: tuple[str, ...] = ()
    password: str = ""
    tls: dict[str, str] | None = None  # {"cert": path, "key": path, "ca": path}: TLS only
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvtier-redis-")))
    cluster: bool = False
    proc: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        if not self.port:
            self.port = free_port(cluster_bus=self.cluster)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        cmd = [REDIS_SERVER, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.dir), "--daemonize", "no", "--protected-mode", "no",
               "--logfile", str(self.dir / "redis.log"), "--dbfilename", "dump.rdb"]
        if self.tls:
            cmd += ["--port", "0", "--tls-port", str(self.port),
                    "--tls-cert-file", self.tls["cert"], "--tls-key-file", self.tls["key"],
                    "--tls-ca-cert-file", self.tls["ca"], "--tls-auth-clients", "no"]
        else:
            cmd += ["--port", str(self.port)]
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]
            if self.tls:
                cmd += ["--tls-cluster", "yes"]
        return cmd + list(self.args)

    def start(self, timeout: float = 10.0) -> RedisServer:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        self.proc = subprocess.Popen(_DIE_WITH_PARENT + self.command(), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited: {self.log_tail()}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on {self.port} did not answer within {timeout} s")

    def _answers(self) -> bool:
        try:
            return bool(self.client(timeout=0.2).ping())
        except redis.exceptions.ConnectionError:
            return False
        except redis.exceptions.TimeoutError:
            return False

    def client(self, timeout: float = 2.0) -> redis.Redis:
        """A plain redis-py client for assertions (TLS with the test CA on a TLS server)."""
        tls: dict[str, object] = {}
        if self.tls:
            tls = {"ssl": True, "ssl_ca_certs": self.tls["ca"]}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None,
                           socket_timeout=timeout, socket_connect_timeout=timeout,
                           **tls)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL: the abrupt death a test wants (no shutdown save, sockets reset)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class RedisClusterServers:
    """Three masters (``replicas`` each, none by default), ``cluster-require-full-coverage
    no`` (a cache keeps serving the slots of the masters that are up when one is down)."""

    masters: int = 3
    replicas: int = 0  # per master (a failover needs one)
    args: tuple[str, ...] = ()
    ports: tuple[int, ...] = ()  # chosen here when empty
    password: str = ""  # requirepass (and masterauth) on every node
    tls: dict[str, str] | None = None  # TLS only (client and cluster bus), see make_tls_files
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + ",".join(n.addr for n in self.nodes)

    def start(self, timeout: float = 30.0) -> RedisClusterServers:
        count = self.masters * (1 + self.replicas)
        ports = self.ports or tuple(free_port(cluster_bus=True) for _ in range(count))
        args = self.args + (("--masterauth", self.password) if self.password else ())
        self.nodes = [RedisServer(port=p, cluster=True, args=args, password=self.password,
                                  tls=self.tls).start() for p in ports]
        auth = ["-a", self.password, "--no-auth-warning"] if self.password else []
        if self.tls:
            auth += ["--tls", "--cacert", self.tls["ca"]]
        cmd = [REDIS_CLI, *auth, "--cluster", "create", *[n.addr for n in self.nodes],
               "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            self.cleanup()
            raise RuntimeError(f"cluster create failed: {done.stdout!r} {done.stderr!r}")
        self.wait_ok(timeout)
        deadline = time.monotonic() + timeout
        while self.replicas and sum(n.client().info("replication").get("master_link_status") == "up"
                                    for n in self.nodes) < self.masters * self.replicas:
            if time.monotonic() > deadline:  # a replica that never synced cannot fail over
                raise RuntimeError("cluster replicas did not sync in time")
            time.sleep(0.05)
        return self

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Wait until every node reports cluster_state:ok and knows all masters."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self._node_ok(n) for n in self.nodes):
                return
            time.sleep(0.05)
        raise RuntimeError("cluster did not reach cluster_state:ok in time")

    def _node_ok(self, node: RedisServer) -> bool:
        try:
            info = node.client(0.5).execute_command("CLUSTER", "INFO")
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        return ("cluster_state:ok" in text
                and f"cluster_known_nodes:{self.masters * (1 + self.replicas)}" in text
                and "cluster_slots_ok:16384" in text)

    def dbsizes(self) -> list[int]:
        return [int(n.client().dbsize()) for n in self.nodes]

    def flushall(self) -> None:
        for n in self.nodes:
            n.client().flushall()

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()


def make_tls_files(directory: Path) -> dict[str, str]:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = d / "ca.key", d / "ca.crt"
    key, csr, crt, ext = d / "server.key", d / "server.csr", d / "server.crt", d / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    steps = [
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key),
         "-out", str(ca_crt), "-days", "2", "-subj", "/CN=kvtier-test-ca"],
        ["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(csr), "-subj", "/CN=127.0.0.1"],
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(ext)],
    ]
    for cmd in steps:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    return {"cert": str(crt), "key": str(key), "ca": str(ca_crt)}


# --- tiers under test ------------------------------------------------------------------------
# Short deadlines and backoff so that outage tests finish in seconds.
FAST = {"timeout_s": 0.5, "backoff_s": 0.05, "backoff_max_s": 0.3}


def tier_for(url: str, **kw: Any) -> RedisTier:
    """A RedisTier on ``url`` with the FAST timings (``kw`` overrides any config field)."""
    return RedisTier(RedisTierConfig(url=url, **{**FAST, **kw}))


@pytest.fixture(name="tiers")
def redis_tiers() -> Iterator[Callable[..., RedisTier]]:
    """Fixture ``tiers`` (import ``redis_tiers`` into a test module to use it): a factory of tiers (``tier_for``'s arguments), each closed when the test ends."""
    made: list[RedisTier] = []

    def make(url: str, **kw: Any) -> RedisTier:
        t = tier_for(url, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()

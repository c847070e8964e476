"""Start and stop real ``kvtier-server`` processes for tests (and benches).

Each server runs as ``python -m kvtier.server.main`` on free loopback ports (port 0 + the
``--ready-file`` the server writes once every listener is bound, so there is no race for a
port), logs into its work directory, and is stopped by the caller (``stop()`` = SIGTERM and
wait, ``kill()`` = SIGKILL). ``restart()`` starts the same node again on the same ports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier.chunk import encode_chunk

ROOT = Path(__file__).resolve().parent.parent
SMALL = ("--cpu-bytes", "64MiB", "--slot-bytes", "1MiB")  # light default for tests


@dataclass
class ServerProc:
    workdir: Path
    args: tuple[str, ...]
    proc: subprocess.Popen[bytes]
    ports: dict[str, int] = field(default_factory=dict)
    name: str = "node"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    def metrics(self) -> str:
        """The node's Prometheus text (its HTTP side port)."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=5) as r:
            return str(r.read().decode())

    @property
    def log(self) -> str:
        path = self.workdir / f"{self.name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"{self.name} ignored SIGTERM for {timeout}s\n{self.log}") from None

    def hang(self, timeout: float = 10.0) -> None:
        """SIGSTOP (the node accepts connections and answers nothing) and wait until every
        thread of it has stopped: ``kill`` returns before they have, and on a loaded host a
        thread may still answer a request sent right after it."""
        self.proc.send_signal(signal.SIGSTOP)
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            states = []
            for stat in Path(f"/proc/{self.proc.pid}/task").glob("*/stat"):
                try:  # the state follows the command name's closing parenthesis
                    states.append(stat.read_text().rpartition(")")[2].split()[0])
                except (FileNotFoundError, ProcessLookupError, IndexError):
                    continue
            if states and all(s in ("T", "t") for s in states):
                return
            time.sleep(0.001)
        raise AssertionError(f"{self.name} did not stop within {timeout}s")

    def kill(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait(10)

    def restart(self, timeout: float = 30.0) -> ServerProc:
        """Start this node again with the same arguments and ports (after stop or kill)."""
        assert not self.alive(), "stop or kill the node first"
        ports = ("--port", str(self.ports["grpc"]), "--http-port", str(self.ports.get("http", -1)),
                 "--data-port", str(self.ports.get("data", -1)))
        return start_server(self.workdir, *self.args, ports=ports, timeout=timeout, name=self.name)


def start_server(workdir: Path, *args: str, ports: tuple[str, ...] | None = None,
                 timeout: float = 30.0, name: str = "node", env: dict[str, str] | None = None,
                 expect_ready: bool = True) -> ServerProc:
    """Start a server with ``args`` (after SMALL defaults and free ports) in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    ready = workdir / f"{name}.ready.json"
    ready.unlink(missing_ok=True)
    ports = ports or ("--port", "0", "--http-port", "0", "--data-port", "0")
    cmd = [sys.executable, "-m", "kvtier.server.main", *SMALL, *ports, "--ready-file", str(ready),
           "--grace", "5", *args]
    full_env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(env or {})}
    log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=workdir)
    log.close()
    server = ServerProc(workdir, tuple(args), proc, name=name)
    if not expect_ready:
        return server
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if ready.exists():
            doc = json.loads(ready.read_text())
            server.ports = {k[: -len("_port")]: v for k, v in doc.items() if k.endswith("_port")}
            return server
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready:\n{server.log}")
        time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"{name} not ready after {timeout}s:\n{server.log}")


def make_chunk(key: bytes, nbytes: int = 4096, seed: int = 0, namespace: bytes = b"\x01" * 32) -> bytes:
    """A valid kvtier chunk for ``key`` with ``nbytes`` of uint8 payload."""
    payload = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    return bytes(encode_chunk(namespace, key, "uint8", (1, 1, nbytes, 1, 1), payload))


def make_keys(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(32) for _ in range(n)]

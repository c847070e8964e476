"""deploy/systemd/kvtier-server.service: its ExecStart line, run as written with the shipped
example config (deploy/kvtier-server.yaml), serves /healthz, keeps what it acknowledged, and
on SIGTERM (the unit's KillSignal) drains and exits 0 within TimeoutStopSec.

What systemd itself would add is given the way the unit gives it: the EnvironmentFile's
``KVTIER_SERVER_*`` lines (here: free ports and a temporary disk directory instead of the
host's); the binary path is the installed ``kvtier-server`` when /usr/local/bin has none.
"""

from __future__ import annotations

import configparser
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import make_chunk, make_keys

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "deploy" / "systemd" / "kvtier-server.service"
EXAMPLE = ROOT / "deploy" / "kvtier-server.yaml"


class _UnitParser(configparser.ConfigParser):
    def optionxform(self, optionstr: str) -> str:  # unit keys are case-sensitive
        return optionstr


def unit() -> configparser.ConfigParser:
    parser = _UnitParser(strict=False, interpolation=None)
    parser.read(UNIT)
    return parser


def exec_start(config: Path) -> list[str]:
    argv = shlex.split(unit()["Service"]["ExecStart"])
    assert argv[0] == "/usr/local/bin/kvtier-server" and "/etc/kvtier/server.yaml" in argv
    binary = argv[0] if os.access(argv[0], os.X_OK) else shutil.which("kvtier-server")
    if binary is None:
        pytest.skip("kvtier-server is not installed (pip install -e .)")
    return [binary] + [str(config) if a == "/etc/kvtier/server.yaml" else a for a in argv[1:]]


def healthz(http: str) -> int:
    try:
        with urllib.request.urlopen(http + "/healthz", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def start(argv: list[str], env: dict[str, str], ready: Path, log: Path) -> tuple[subprocess.Popen[bytes], dict[str, int]]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    end = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < end, log.read_text()
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())


def test_unit_is_well_formed() -> None:
    service = unit()["Service"]
    assert service["KillSignal"] == "SIGTERM" and service["User"] == "kvtier"
    # no private /dev (or IPC): engines on the host must see this daemon's /dev/shm segments
    assert "PrivateDevices" not in service and "PrivateIPC" not in service
    grace = float(yaml.safe_load(EXAMPLE.read_text())["grace_s"])
    assert float(service["TimeoutStopSec"]) > 2 * grace
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return
    done = subprocess.run([analyze, "verify", str(UNIT)], capture_output=True, text=True,
                          timeout=60, check=False)
    # The only complaint allowed is the binary's absence on a machine without it installed.
    problems = [line for line in (done.stdout + done.stderr).splitlines()
                if line.strip() and "/usr/local/bin/kvtier-server" not in line]
    assert not problems, problems


def test_exec_start_serves_healthz_and_sigterm_drains_to_exit_0(tmp_path: Path) -> None:
    ready, log = tmp_path / "ready.json", tmp_path / "server.log"
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           # what /etc/kvtier/kvtier-server.env would say on a host; ports 0 = free ones
           "KVTIER_SERVER_PORT": "0", "KVTIER_SERVER_HTTP_PORT": "0", "KVTIER_SERVER_DATA_PORT": "0",
           "KVTIER_SERVER_DISK__PATH": str(tmp_path / "disk"),
           "KVTIER_SERVER_READY_FILE": str(ready)}
    argv = exec_start(EXAMPLE)
    proc, ports = start(argv, env, ready, log)
    try:
        http = f"http://127.0.0.1:{ports['http_port']}"
        assert healthz(http) == 200
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(f"127.0.0.1:{ports['grpc_port']}",)))
        keys = make_keys(3, seed=11)
        chunks = [make_chunk(k, 8192, i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 3
        tier.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(float(unit()["Service"]["TimeoutStopSec"])) == 0
        text = log.read_text()
        assert "draining" in text and "stopped cleanly" in text, text
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    # the example config keeps chunks on disk: a restart serves them again
    proc, ports = start(argv, env, ready, log)
    try:
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(f"127.0.0.1:{ports['grpc_port']}",)))
        assert tier.get(keys) == chunks
        tier.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0

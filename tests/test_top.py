"""``kvtier top`` against two real kvtier-server processes that a real usage reporter feeds:
``--once --json`` is the cluster document, the table shows replicas and a dead node, the live
view refreshes in place, a hostile name reaches the terminal without its control characters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.config import KVTierConfig
from kvtier.usage.reporter import UsageReporter
from tests.kvtier_servers import ROOT, ServerProc, start_server

HOSTILE = "[bold red]evil[/] replica"  # rich markup: must print as is
EVIL_NODE = "top-b\x1b[2J\x07"  # terminal control: must not reach the terminal


def top(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "top", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


@pytest.fixture()
def fed(tmp_path: Path) -> Iterator[tuple[list[ServerProc], UsageReporter]]:
    nodes = [start_server(tmp_path / str(i), "--node-id", name, name=str(i)) for i, name in enumerate(("top-a", EVIL_NODE))]
    cfg = KVTierConfig.from_dict({"grpc": {"enabled": True, "nodes": [n.address for n in nodes]},
                                  "usage": {"interval_s": 60}})
    rep = UsageReporter(cfg, "llama-3-8b", "hf", HOSTILE)
    rep.counters.record_lookup(1000, {"cpu": 600, "disk": 150}, "absent", prefix="ab" * 8)
    rep.counters.record_restore(750, 0.02, 1 << 20)
    rep.counters.record_ttft(True, 0.1)
    assert rep.send_now(5.0) == 2
    try:
        yield nodes, rep
    finally:
        rep.close()
        for n in nodes:
            n.kill()


def hostport(node: ServerProc) -> str:
    return f"127.0.0.1:{node.ports['http']}"


def test_once_json_merges_two_servers_that_do_not_list_each_other(fed: tuple[list[ServerProc], Any]) -> None:
    (a, b), _ = fed
    out = top("--server", hostport(a), "--server", hostport(b), "--once", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert [n["node_id"] for n in doc["nodes"]] == ["top-a", EVIL_NODE] and doc["nodes_up"] == 2
    t = doc["engines"]["totals"]
    assert (t["prompt_tokens"], t["hit_tokens"], t["hits_per_tier"]) == (1000, 750, {"cpu": 600, "disk": 150})
    [rep] = doc["engines"]["replicas"]  # reported to both nodes, counted once
    assert rep["replica"] == HOSTILE and rep["nodes"] == sorted(["top-a", EVIL_NODE])
    one = json.loads(top("--server", hostport(a), "--once", "--json").stdout)  # one server: its /api/cluster
    assert one["engines"]["totals"] == t and [n["node_id"] for n in one["nodes"]] == ["top-a"]


def test_table_shows_replicas_and_a_dead_node_without_control_characters(fed: tuple[list[ServerProc], Any]) -> None:
    (a, b), _ = fed
    text = top("--server", hostport(a), "--server", hostport(b), "--once").stdout
    assert "top-b?[2J?" in text and "\x1b" not in text and "\x07" not in text and HOSTILE in text
    b.kill()
    out = top("--server", hostport(a), "--server", hostport(b), "--once")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "prompt-token hit ratio 75.0%" in text and HOSTILE in text
    assert "DOWN" in text and "top-a" in text and "hit: cpu" in text and "miss: absent" in text
    assert top("--server", hostport(b), "--once").returncode == 1  # nobody answered


def test_live_view_refreshes_in_place(fed: tuple[list[ServerProc], Any]) -> None:
    """On a terminal (a pty) the view redraws every --interval and Ctrl-C ends it cleanly."""
    import pty
    import select
    import signal

    (a, _), _ = fed
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "COLUMNS": "200", "LINES": "60", "TERM": "xterm"}
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "top", "--server", hostport(a), "--interval", "0.2"],
                            stdin=follower, stdout=follower, stderr=follower, env=env, close_fds=True)
    os.close(follower)
    out = b""
    end = time.monotonic() + 20
    try:
        while time.monotonic() < end and out.count(b"prompt-token hit ratio") < 4:
            if select.select([leader], [], [], 0.5)[0]:
                out += os.read(leader, 65536)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    assert out.count(b"prompt-token hit ratio") >= 4, out[-2000:]
    assert b"\x1b[" in out  # redrawn in place (cursor moves), not appended as plain lines


def test_bad_arguments_are_usage_errors_not_tracebacks() -> None:
    for args, message in ((("--server", "garbage"), "'garbage' is not host:port"),
                          (("--interval", "-1"), "expected seconds > 0, got -1"),
                          (("--timeout", "0"), "expected seconds > 0, got 0"),
                          (("--interval", "abc"), "expected seconds, got 'abc'")):
        proc = top("--once", *args)
        assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr

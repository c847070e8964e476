"""kvtier.tiers.remote.heap: a process that frees a batch of fresh chunk-sized ``bytes`` gets the
same pages back for the next batch instead of faulting in new ones (glibc's trim threshold
raised), and a process whose environment chose malloc settings is left alone. Each case runs
in its own interpreter (malloc settings are per process); page faults are the kernel's count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Batches of 8 fresh 1 MiB bytes received from a socket (one recv(n, MSG_WAITALL) each, as the
# socket path's get does), each batch dropped before the next; the minor faults taken by
# batches 2..N.
CHILD = """
import json, os, resource, socket, sys, threading
from kvtier.tiers.remote.heap import retain_freed_blocks
applied = retain_freed_blocks() if sys.argv[1] == "retain" else None
ours, theirs = socket.socketpair()
payload = os.urandom(1 << 20)
def feed():
    while True:
        theirs.sendall(payload)
threading.Thread(target=feed, daemon=True).start()
def batch():
    return [ours.recv(1 << 20, socket.MSG_WAITALL) for _ in range(8)]
batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    batch()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def run(mode: str, **env: str) -> dict[str, object]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env={**clean, "PYTHONPATH": str(ROOT), **env},
                         capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc on Linux")
def test_freed_batches_are_reused_not_faulted_in_again() -> None:
    kept = run("retain")
    default = run("default")  # the control: glibc's own thresholds
    assert kept["applied"] is True
    pages = 20 * 8 * (1 << 20) // 4096  # what faulting in every batch again would cost
    assert isinstance(kept["faults"], int) and isinstance(default["faults"], int)
    assert default["faults"] > pages // 2, default  # glibc gives the pages back after each batch
    assert kept["faults"] < pages // 20, kept  # kept: a few faults, not one per page


def test_malloc_settings_from_the_environment_are_left_alone() -> None:
    for env in ({"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}):
        assert run("retain", **env)["applied"] is False, env

"""kvtier's threads start off the engine's compute cores, native ones included.

vLLM's CPU worker binds its forward thread to a compute core; a thread inherits its creator's
mask. gRPC starts native threads (event engine, timer, lifeguard) when a grpc tier connects,
which ``pin_existing`` cannot move by name: ``on_spare_cpus`` makes them start on the spare
CPUs. Real kvtier-server, real grpc tier; each case runs in a fresh interpreter (gRPC keeps its
threads process-wide while any channel lives, so an earlier test's could be reused) and reads
the thread masks from /proc.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                                or not Path("/proc/self/task").is_dir(),
                                reason="needs Linux thread affinity and two CPUs")

_SCENARIO = r"""
import json, os, sys
from kvtier.config import KVTierConfig
from kvtier.store import TieredStore
from kvtier_vllm.threads import background_pinner, on_spare_cpus

address, spare_build = sys.argv[1], sys.argv[2] == "1"
compute = min(os.sched_getaffinity(0))
os.sched_setaffinity(0, {compute})  # as vLLM's CPU worker binds its forward thread

def tasks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = open(f"/proc/self/task/{tid}/comm").read().strip()
            out[tid] = (name, sorted(os.sched_getaffinity(int(tid))))
        except (OSError, ValueError):
            pass
    return out

before = tasks()
pin = background_pinner()
cfg = KVTierConfig.load(None, overrides={"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": [address]}})
import threading
if spare_build:
    with on_spare_cpus(pin):
        store = TieredStore.from_config(cfg)
    # As in the worker: lookups run on kvtier's own threads (LookupServer, thread_init=pin), so
    # whatever a request starts lazily (a hedged attempt's thread) inherits the spare CPUs.
    def lookup():
        pin()
        store.lookup([b"k" * 32])
    t = threading.Thread(target=lookup)
    t.start()
    t.join()
else:
    store = TieredStore.from_config(cfg)
    store.lookup([b"k" * 32])  # one round trip: the channel and its threads are up
new = [v for k, v in tasks().items() if k not in before]
print(json.dumps({"compute": compute, "spare": sorted(getattr(pin, "spare", [])), "new": new,
                  "caller": sorted(os.sched_getaffinity(0))}))
store.close()
"""


@pytest.mark.parametrize("spare_build", [True, False])
def test_a_grpc_tier_built_on_spare_cpus_starts_no_thread_on_the_compute_core(tmp_path: Path, spare_build: bool) -> None:
    from tests.kvtier_servers import start_server

    server = start_server(tmp_path / "server", "--cpu-bytes", "64MiB", "--slot-bytes", "1MiB", timeout=60)
    try:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "connectors")]))
        proc = subprocess.run([sys.executable, "-c", _SCENARIO, server.address, "1" if spare_build else "0"],
                              capture_output=True, text=True, env=env, timeout=120, check=True)
    finally:
        server.stop()
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    compute = res["compute"]
    assert compute not in res["spare"] and res["caller"] == [compute]  # the caller's mask is back
    native = [(name, cpus) for name, cpus in res["new"] if name.startswith(("grpc", "event_engine"))]
    assert native, f"gRPC started no native thread? {res['new']}"
    on_compute = sorted({name for name, cpus in res["new"] if compute in cpus})
    if spare_build:
        assert not on_compute, f"threads on the compute core {compute}: {on_compute}"
    else:  # the control: built on the forward thread, gRPC's threads share its core
        assert {name for name, _ in native} <= set(on_compute)

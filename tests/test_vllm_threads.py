"""kvtier's threads start off the engine's compute cores, native ones included.

vLLM's CPU worker binds its forward thread to a compute core; a thread inherits its creator's
mask. gRPC starts native threads (event engine, timers) when a grpc tier connects, which
``pin_existing`` cannot move by name: ``on_spare_cpus`` makes them start on the spare CPUs.
Real kvtier-server, real grpc tier; the thread masks are read from /proc.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                                or not Path("/proc/self/task").is_dir(),
                                reason="needs Linux thread affinity and two CPUs")


def _masks() -> dict[int, tuple[str, set[int]]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            out[int(tid)] = (name, os.sched_getaffinity(int(tid)))
        except (OSError, ValueError):  # the thread ended while we looked
            continue
    return out


def _grpc_store(address: str) -> object:
    from kvtier.config import KVTierConfig
    from kvtier.store import TieredStore

    cfg = KVTierConfig.load(None, overrides={"cpu": {"enabled": False},
                                             "grpc": {"enabled": True, "nodes": [address]}})
    store = TieredStore.from_config(cfg)
    store.lookup([b"k" * 32])  # one round trip: the channel and its threads are up
    return store


@pytest.mark.parametrize("spare_build", [True, False])
def test_a_grpc_tier_built_on_spare_cpus_starts_no_thread_on_the_compute_core(tmp_path: Path, spare_build: bool) -> None:
    from kvtier_vllm.threads import background_pinner, on_spare_cpus

    from tests.kvtier_servers import start_server

    server = start_server(tmp_path / "server", "--cpu-bytes", "64MiB", "--slot-bytes", "1MiB", timeout=60)
    own = os.sched_getaffinity(0)
    compute = min(own)
    store = None
    try:
        os.sched_setaffinity(0, {compute})  # as vLLM's CPU worker binds its forward thread
        before = set(_masks())
        pin = background_pinner()
        assert compute not in pin.spare  # type: ignore[attr-defined]
        if spare_build:
            with on_spare_cpus(pin):
                store = _grpc_store(server.address)
            assert os.sched_getaffinity(0) == {compute}  # the caller's own mask is back
        else:
            store = _grpc_store(server.address)
        new = {tid: m for tid, m in _masks().items() if tid not in before}
        native = {tid: m for tid, m in new.items() if m[0].startswith(("grpc", "event_engine"))}
        assert native, f"gRPC started no native thread? {new}"
        on_compute = {m[0] for m in new.values() if compute in m[1]}
        if spare_build:
            assert not on_compute, f"threads on the compute core {compute}: {on_compute}"
        else:  # the control: built on the forward thread, gRPC's threads share its core
            assert {m[0] for m in native.values()} <= on_compute
    finally:
        os.sched_setaffinity(0, own)
        if store is not None:
            store.close()  # type: ignore[attr-defined]
        server.stop()

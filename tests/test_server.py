"""kvtier-server as a process: every RPC round trip, Lookup semantics, Health, the HTTP side
port, graceful SIGTERM, restart from the disk dir, the CLI, and no torch in the daemon."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc
from tests.kvtier_servers import ROOT, ServerProc, make_chunk, make_keys, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    s = start_server(tmp_path_factory.mktemp("srv"), "--disk-dir", "disk", "--disk-bytes", "64MiB")
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture(scope="module")
def stub(server: ServerProc) -> Iterator[pb_grpc.KVTierStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.KVTierStub(channel)


def put(stub: pb_grpc.KVTierStub, keys: list[bytes], nbytes: int = 2048) -> list[bool]:
    items = [pb.PutItem(key=k, chunk=make_chunk(k, nbytes, i), depth=i) for i, k in enumerate(keys)]
    return list(stub.Put(iter([pb.PutRequest(items=items)]), timeout=10).stored)


def health_status(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_info_advertises_limits_and_data_path(stub: pb_grpc.KVTierStub, server: ServerProc) -> None:
    info = stub.Info(pb.InfoRequest(), timeout=5)
    assert info.key_bytes == 32 and info.max_batch_keys == 4096
    assert 0 < info.max_chunk_bytes < info.max_message_bytes
    assert info.tenant == "default" and not info.auth_required
    port = server.ports["data"]
    assert [(e.kind, e.port, e.tls) for e in info.data_endpoints] == [("socket", port, False), ("shm", port, False)]


def test_put_get_delete_round_trip(stub: pb_grpc.KVTierStub) -> None:
    keys = make_keys(6, seed=1)
    assert put(stub, keys[:4]) == [True] * 4
    replies = list(stub.Get(pb.GetRequest(keys=keys), timeout=5))
    items = [it for r in replies for it in r.items]
    assert [it.index for it in items] == list(range(6))
    for i, it in enumerate(items[:4]):
        assert it.chunk == make_chunk(keys[i], 2048, i) and not it.miss_reason
    assert [(it.chunk, it.miss_reason) for it in items[4:]] == [(b"", "absent")] * 2
    deleted = stub.Delete(pb.DeleteRequest(keys=[keys[0], keys[5], keys[1]]), timeout=5)
    assert (deleted.deleted, list(deleted.existed)) == (2, [True, False, True])
    items = [it for r in stub.Get(pb.GetRequest(keys=keys[:3]), timeout=5) for it in r.items]
    assert [bool(it.chunk) for it in items] == [False, False, True]


def test_put_streams_several_messages(stub: pb_grpc.KVTierStub) -> None:
    keys = make_keys(10, seed=2)
    msgs = [pb.PutRequest(items=[pb.PutItem(key=k, chunk=make_chunk(k, 1024, 7))]) for k in keys]
    assert list(stub.Put(iter(msgs), timeout=10).stored) == [True] * 10
    assert stub.Lookup(pb.LookupRequest(keys=keys), timeout=5).hits == 10


def test_lookup_counts_leading_present_keys(stub: pb_grpc.KVTierStub) -> None:
    keys = make_keys(8, seed=3)
    present = [0, 1, 2, 4, 5, 7]
    assert put(stub, [keys[i] for i in present]) == [True] * len(present)
    for start in range(8):
        want = 0
        while start + want < 8 and start + want in present:
            want += 1
        reply = stub.Lookup(pb.LookupRequest(keys=keys[start:]), timeout=5)
        assert reply.hits == want, start
        assert reply.reason == "absent"
    assert stub.Lookup(pb.LookupRequest(keys=[]), timeout=5).hits == 0


def test_get_streams_big_batches_in_order(stub: pb_grpc.KVTierStub) -> None:
    keys = make_keys(24, seed=4)
    assert put(stub, keys, nbytes=512 << 10) == [True] * 24  # 12 MiB in one message
    items = [it for r in stub.Get(pb.GetRequest(keys=keys), timeout=20) for it in r.items]
    assert [it.index for it in items] == list(range(24))
    assert all(it.chunk == make_chunk(k, 512 << 10, i) for i, (k, it) in enumerate(zip(keys, items)))


def test_stats_reports_usage(stub: pb_grpc.KVTierStub) -> None:
    keys = make_keys(3, seed=5)
    put(stub, keys, nbytes=4096)
    stats = stub.Stats(pb.StatsRequest(), timeout=5)
    (tenant,) = stats.tenants
    assert tenant.tenant == "default" and tenant.entries >= 3 and tenant.used_bytes >= 3 * 4096
    assert [t.name for t in tenant.tiers] == ["cpu", "disk"]
    assert tenant.quota_bytes == 64 << 20
    assert stub.Stats(pb.StatsRequest(tenant="*"), timeout=5).tenants[0].tenant == "default"


def test_health_serving(server: ServerProc) -> None:
    assert health_status(server.address) == health_pb2.HealthCheckResponse.SERVING
    assert health_status(server.address, "kvtier.v1.KVTier") == health_pb2.HealthCheckResponse.SERVING


def test_http_side_port(server: ServerProc, stub: pb_grpc.KVTierStub) -> None:
    put(stub, make_keys(2, seed=6))
    metrics = server.metrics()
    assert 'kvtier_server_requests_total{code="OK",method="Put"}' in metrics
    assert 'kvtier_server_tier_used_bytes{tenant="default",tier="disk"}' in metrics
    assert urllib.request.urlopen(server.http + "/healthz", timeout=5).read() == b"ok\n"
    stats = json.loads(urllib.request.urlopen(server.http + "/api/stats", timeout=5).read())
    assert stats["tenants"][0]["tenant"] == "default" and stats["tenants"][0]["entries"] >= 2
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(server.http + "/nope", timeout=5)
    assert err.value.code == 404


def test_sigterm_finishes_in_flight_and_restart_serves_from_disk(tmp_path: Path) -> None:
    s = start_server(tmp_path, "--disk-dir", "disk", "--disk-bytes", "32MiB")
    keys = make_keys(6, seed=8)
    in_flight = threading.Event()

    def slow_stream() -> Iterator[pb.PutRequest]:
        for i, k in enumerate(keys):
            yield pb.PutRequest(items=[pb.PutItem(key=k, chunk=make_chunk(k, 8192, i))])
            if i == 0:
                in_flight.wait(10)  # hold the stream open until the server is handling it
            time.sleep(0.15)

    with grpc.insecure_channel(s.address) as ch, grpc.insecure_channel(s.address) as probe:
        fut = pb_grpc.KVTierStub(ch).Put.future(slow_stream(), timeout=20)
        # SIGTERM only once the server has stored the first chunk: before that the call may not
        # have reached the handler, and refusing a call that never started is correct shutdown.
        deadline = time.monotonic() + 10
        while pb_grpc.KVTierStub(probe).Lookup(pb.LookupRequest(keys=keys[:1]), timeout=5).hits != 1:
            assert time.monotonic() < deadline, "the first chunk never arrived"
            time.sleep(0.01)
        s.proc.send_signal(15)  # SIGTERM while the stream is mid-way
        in_flight.set()
        assert list(fut.result().stored) == [True] * 6
    assert s.proc.wait(20) == 0, s.log
    assert "stopped cleanly" in s.log
    s2 = s.restart()
    try:
        with grpc.insecure_channel(s2.address) as ch:
            st = pb_grpc.KVTierStub(ch)
            assert st.Lookup(pb.LookupRequest(keys=keys), timeout=5).hits == 6
            items = [it for r in st.Get(pb.GetRequest(keys=keys), timeout=5) for it in r.items]
            assert [it.chunk for it in items] == [make_chunk(k, 8192, i) for i, k in enumerate(keys)]
    finally:
        assert s2.stop() == 0


def test_no_torch_in_the_daemon() -> None:
    code = (
        "import sys, asyncio\n"
        "import kvtier.server.main, kvtier.server.app, kvtier.server.dataplane\n"
        "from kvtier.server.config import load_server_config\n"
        "from kvtier.server.app import KVTierServer\n"
        "async def go():\n"
        "    s = KVTierServer(load_server_config(None, {'port': 0, 'http_port': -1, 'data_port': 0,"
        " 'cpu.capacity_bytes': '8MiB', 'cpu.slot_bytes': '1MiB'}, env={}))\n"
        "    await s.start(); await s.stop()\n"
        "asyncio.run(go())\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_cli_help_and_config_errors(tmp_path: Path) -> None:
    def run(*a: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvtier.server.main", *a], cwd=ROOT,
                              capture_output=True, text=True, timeout=60, check=False)

    help_text = run("--help").stdout
    for needle in ("--disk-dir", "--tokens-file", "--tls-cert", "--allow-insecure-remote", "KVTIER_SERVER_"):
        assert needle in help_text
    bad = run("--port", "not-a-port")
    assert bad.returncode == 2 and "port" in bad.stderr
    remote = run("--host", "0.0.0.0")
    assert remote.returncode == 2 and "--allow-insecure-remote" in remote.stderr
    tiny = run("--default-quota", "64KiB", "--print-config")  # under the smallest tier: unenforceable
    assert tiny.returncode == 2 and "default_quota_bytes (65536) is under 1MiB" in tiny.stderr, tiny.stderr
    stray = run("--redis-url", "redis://10.0.0.7:6379/0", "--print-config")  # no --lower redis
    assert stray.returncode == 2 and "add --lower redis" in stray.stderr, stray.stderr
    assert run("--lower", "redis", "--redis-url", "redis://10.0.0.7:6379/0", "--print-config").returncode == 0
    cfg = json.loads(run("--print-config", "--set", "cpu.capacity_bytes=2GiB").stdout)
    assert cfg["host"] == "127.0.0.1" and cfg["port"] == 50051 and cfg["cpu"]["capacity_bytes"] == 2 << 30
    (tmp_path / "s.yaml").write_text("port: 7001\ndisk: {enabled: true, path: /tmp/x}\n")
    env_run = subprocess.run([sys.executable, "-m", "kvtier.server.main", "--config", str(tmp_path / "s.yaml"),
                              "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
                             env={"KVTIER_SERVER_PORT": "7002", "PATH": "/usr/bin:/bin"})
    doc = json.loads(env_run.stdout)
    assert doc["port"] == 7002 and doc["disk"]["enabled"] is True  # env beats file


def test_busy_port_fails_loudly(server: ServerProc, tmp_path: Path) -> None:
    other = start_server(tmp_path, ports=("--port", str(server.ports["grpc"]), "--http-port", "0",
                                          "--data-port", "0"), expect_ready=False)
    assert other.proc.wait(30) == 1
    assert "cannot start" in other.log

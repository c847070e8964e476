"""kvtier-server's KV events: a real server process publishes over ZMQ and a subscriber decodes
every message with vLLM's own ``KVEventBatch`` decoder (vLLM's wire format: topic, 8-byte
sequence, msgpack payload). A removal follows an eviction (a 1 MiB tier), and a Delete."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc
from tests.kv_event_subscriber import Subscriber
from tests.kvtier_servers import ROOT, make_chunk, make_keys, start_server

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in ("zmq", "msgspec", "vllm")),
    reason="needs pyzmq, msgspec and vllm (whose decoder the subscriber uses)")

CHUNK = 200_000      # payload bytes: 5 chunks fit a 1 MiB tier, the 6th evicts
NS = bytes(range(32))


@pytest.fixture()
def sub() -> Iterator[Subscriber]:
    s = Subscriber()
    yield s
    s.close()


def put(stub: pb_grpc.KVTierStub, keys: list[bytes], parents: list[bytes]) -> list[bool]:
    items = [pb.PutItem(key=k, chunk=make_chunk(k, CHUNK, i, namespace=NS), depth=i, parent=p)
             for i, (k, p) in enumerate(zip(keys, parents))]
    return list(stub.Put(iter([pb.PutRequest(items=items)]), timeout=10).stored)


def wait_joined(stub: pb_grpc.KVTierStub, sub: Subscriber) -> None:
    """ZMQ drops what a PUB sends before its peer's subscription arrives: put a probe chunk
    until its event comes through, then every later event reaches the subscriber."""
    from vllm.distributed.kv_events import BlockRemoved

    probe = make_keys(1, seed=99)[0]
    end = time.monotonic() + 20
    while time.monotonic() < end:
        assert put(stub, [probe], [b""]) == [True]
        if any(probe in e.block_hashes for e in sub.events(0.3)):
            break
    else:
        raise AssertionError("no KV event reached the subscriber in 20 s")
    stub.Delete(pb.DeleteRequest(keys=[probe]), timeout=5)
    while time.monotonic() < end:  # drain up to the probe's removal
        if any(isinstance(e, BlockRemoved) and probe in e.block_hashes for e in sub.events(0.3)):
            return
    raise AssertionError("the probe's removal never came")


@pytest.mark.parametrize("disk", [False, True], ids=["ram", "disk"])
def test_server_publishes_stored_and_removed_in_vllm_format(tmp_path: Path, sub: Subscriber, disk: bool) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    tier = ("--disk-dir", "disk", "--disk-bytes", "1MiB") if disk else ("--cpu-bytes", "1MiB", "--slot-bytes", "200KiB")
    server = start_server(tmp_path, *tier, "--node-id", "n1", "--events-endpoint",
                          f"tcp://127.0.0.1:{sub.port}", "--set", "events_topic=kv")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.KVTierStub(channel)
            wait_joined(stub, sub)
            keys = make_keys(6, seed=1)
            parents = [b""] + keys[:-1]
            assert put(stub, keys[:5], parents[:5]) == [True] * 5
            stored = sub.events(1.0)
            media = ["STORAGE", "CPU"] if disk else ["CPU"]  # disk, then its RAM cache
            assert all(isinstance(e, BlockStored) for e in stored), stored
            assert [(e.medium, e.block_hashes) for e in stored] == [(m, [k]) for m in media for k in keys[:5]]
            for e in stored:
                assert e.parent_block_hash == (parents[keys.index(e.block_hashes[0])] or None)
                assert (e.ownership, e.block_size, e.token_ids) == ("kvtier-server:n1", CHUNK, [])
                assert e.extra_keys == [(NS.hex(),)]
            held = {(e.block_hashes[0], e.medium) for e in stored}

            # A sixth chunk does not fit the 1 MiB tier: it evicts one (its policy's choice).
            assert put(stub, keys[5:], parents[5:]) == [True]
            after = sub.events(1.0)
            removed = [e for e in after if isinstance(e, BlockRemoved)]
            assert len(removed) == 1 and len(removed[0].block_hashes) == 1, after
            victim = removed[0].block_hashes[0]
            assert victim in keys[:5] and removed[0].medium == media[0]
            assert [(e.medium, e.block_hashes) for e in after if isinstance(e, BlockStored)] == [(m, [keys[5]]) for m in media]
            held = _apply(held, after)
            # The router's view is the node's: a chunk is served while some medium holds it.
            for k in keys:
                assert stub.Lookup(pb.LookupRequest(keys=[k]), timeout=5).hits == any(h == k for h, _ in held)

            stub.Delete(pb.DeleteRequest(keys=[keys[5], victim]), timeout=5)
            gone = sub.events(1.0)
            assert all(isinstance(e, BlockRemoved) for e in gone)
            assert sorted(e.medium for e in gone if keys[5] in e.block_hashes) == sorted(media)
            held = _apply(held, gone)
            assert not any(h in (keys[5], victim) for h, _ in held)
        assert sub.seqs == list(range(sub.seqs[0], sub.seqs[0] + len(sub.seqs)))  # no gap
    finally:
        assert server.stop() == 0, server.log


def _apply(held: set[tuple[bytes, str]], events: list[Any]) -> set[tuple[bytes, str]]:
    """A router's index of (block hash, medium) after ``events``."""
    from vllm.distributed.kv_events import BlockStored

    out = set(held)
    for e in events:
        for h in e.block_hashes:
            (out.add if isinstance(e, BlockStored) else out.discard)((h, e.medium))
    return out


def test_server_without_the_events_extra_starts_with_events_off() -> None:
    """pyzmq and msgspec are optional: blocked here, the server still starts (events off) and
    refuses ``events_endpoint`` with an error naming the extra."""
    code = (
        "import sys, asyncio\n"
        "sys.modules['zmq'] = None; sys.modules['msgspec'] = None\n"
        "from kvtier.errors import ConfigError\n"
        "from kvtier.server.config import load_server_config\n"
        "from kvtier.server.app import KVTierServer\n"
        "base = {'port': 0, 'http_port': -1, 'data_port': -1, 'cpu.capacity_bytes': '8MiB', 'cpu.slot_bytes': '1MiB'}\n"
        "async def go(extra):\n"
        "    s = KVTierServer(load_server_config(None, {**base, **extra}, env={}))\n"
        "    try:\n"
        "        await s.start()\n"
        "    finally:\n"
        "        await s.stop()\n"
        "asyncio.run(go({}))\n"
        "try:\n"
        "    asyncio.run(go({'events_endpoint': 'tcp://127.0.0.1:1'}))\n"
        "except ConfigError as exc:\n"
        "    print('refused:', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "kvtier[events]" in out.stdout, out.stdout


def test_bad_events_endpoint_is_a_config_error() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.server.main", "--events-endpoint", "localhost:5557",
                          "--print-config"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode != 0 and "events_endpoint" in out.stderr and "ZMQ endpoint" in out.stderr

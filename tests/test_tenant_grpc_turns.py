"""One tenant's gRPC bulk streams against another tenant's calls, on a real kvtier-server
(kvtier.server.fair_gate): each tenant has its own turns for Get replies, so a tenant whose
clients open Get streams and stop reading them stalls its own further Gets, never
another tenant's. (How much a tenant's busy streams slow another's calls is a figure of
bench/tenant_flood.py, not a timed test.)"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef"
# A client that reads nothing keeps the server's sends waiting on HTTP/2 flow control: keep
# its receive window at grpc's initial 64 KiB (no BDP probing to widen it).
STALLED = [("grpc.http2.bdp_probe", 0), ("grpc.max_receive_message_length", 64 << 20)]


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work: Path = tmp_path_factory.mktemp("turns")
    tokens = work / "tokens"
    tokens.write_text(f"{ALICE} alice\n{BOB} bob\n")
    tokens.chmod(0o600)
    s = start_server(work, "--tokens-file", str(tokens), "--cpu-bytes", "64MiB", "--slot-bytes", "1MiB",
                     env={"KVTIER_SERVER_GRPC_GET_TURNS_PER_TENANT": "1"})
    yield s
    assert s.stop() == 0, s.log


def put(stub: pb_grpc.KVTierStub, token: str, keys: list[bytes], nbytes: int) -> None:
    for key in keys:
        item = pb.PutItem(key=key, chunk=make_chunk(key, nbytes))
        assert list(stub.Put(iter([pb.PutRequest(items=[item])]), metadata=md(token), timeout=30).stored) == [True]


def get(stub: pb_grpc.KVTierStub, token: str, keys: list[bytes], timeout: float) -> dict[int, bytes]:
    return {i.index: i.chunk for r in stub.Get(pb.GetRequest(keys=keys), metadata=md(token), timeout=timeout)
            for i in r.items}


def wait_until_stalled(stub: pb_grpc.KVTierStub, key: bytes) -> None:
    """Until alice's small Get times out (the unread streams have reached the server and hold
    her turn), at most 10 s."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        try:
            get(stub, ALICE, [key], timeout=0.5)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err  # type: ignore[attr-defined]
            return
        time.sleep(0.05)
    raise AssertionError("alice's Get never waited: her unread streams held no turn")


def test_unread_streams_stall_only_their_own_tenant(server: ServerProc) -> None:
    big, small = make_keys(12, seed=61), make_keys(2, seed=62)
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.KVTierStub(channel)
        put(stub, ALICE, big, 900_000)
        put(stub, ALICE, small[:1], 4096)
        put(stub, BOB, small, 4096)
        with grpc.insecure_channel(server.address, options=STALLED) as stalled_channel:
            stalled = pb_grpc.KVTierStub(stalled_channel)
            unread = [stalled.Get(pb.GetRequest(keys=big), metadata=md(ALICE), timeout=60) for _ in range(3)]
            try:
                # alice's one turn is held by a send nobody reads: her next Get waits ...
                wait_until_stalled(stub, small[0])
                # ... bob's do not, nor anyone's small calls
                assert get(stub, BOB, small, timeout=10) == {0: make_chunk(small[0], 4096),
                                                             1: make_chunk(small[1], 4096)}
                put(stub, BOB, make_keys(1, seed=63), 4096)
                assert stub.Lookup(pb.LookupRequest(keys=small[:1]), metadata=md(ALICE), timeout=10).hits == 1
            finally:
                for call in unread:
                    call.cancel()
        # the cancelled streams gave alice's turn back
        assert get(stub, ALICE, small[:1], timeout=10) == {0: make_chunk(small[0], 4096)}
        assert get(stub, ALICE, big[:2], timeout=10) == {0: make_chunk(big[0], 900_000), 1: make_chunk(big[1], 900_000)}


def test_a_stream_nobody_reads_gives_its_turn_back(tmp_path: Path) -> None:
    """With ``grpc_send_stall_s`` 2 s: alice's unread streams (no client deadline, never
    cancelled) give her one turn back after 2 s each, so her next Get goes through while they
    still wait; read later, they deliver every chunk. Before, a client that hung with no
    deadline held its tenant's turns until TCP gave up."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{ALICE} alice\n")
    tokens.chmod(0o600)
    node = start_server(tmp_path / "n", "--tokens-file", str(tokens), "--cpu-bytes", "64MiB", "--slot-bytes", "1MiB",
                        env={"KVTIER_SERVER_GRPC_GET_TURNS_PER_TENANT": "1", "KVTIER_SERVER_GRPC_SEND_STALL_S": "2"})
    try:
        big, small = make_keys(12, seed=64), make_keys(1, seed=65)
        with grpc.insecure_channel(node.address) as channel, \
                grpc.insecure_channel(node.address, options=STALLED) as stalled_channel:
            stub = pb_grpc.KVTierStub(channel)
            put(stub, ALICE, big, 900_000)
            put(stub, ALICE, small, 4096)
            unread = [pb_grpc.KVTierStub(stalled_channel).Get(pb.GetRequest(keys=big), metadata=md(ALICE))
                      for _ in range(2)]
            wait_until_stalled(stub, small[0])
            end = time.monotonic() + 15
            while True:  # each unread stream holds the one turn for ~2 s, then goes on without
                try:
                    assert get(stub, ALICE, small, timeout=5) == {0: make_chunk(small[0], 4096)}
                    break
                except grpc.RpcError as err:
                    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
                    assert time.monotonic() < end, "the unread streams kept alice's turn"
            for call in unread:  # nothing was lost for them
                got = {i.index: i.chunk for r in call for i in r.items}
                assert got == {i: make_chunk(k, 900_000) for i, k in enumerate(big)}
        assert "took no reply" in node.log
    finally:
        assert node.stop() == 0, node.log

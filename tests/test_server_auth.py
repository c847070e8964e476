"""Tenancy and security of kvtier-server: the auth/isolation matrix over gRPC and the data
path, per-tenant quota with eviction inside it, TLS and mutual TLS from cert files."""

from __future__ import annotations

import datetime
import ipaddress
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.config import GrpcTierConfig
from kvtier.errors import ConfigError
from kvtier.protocol.frames import ERROR, FrameReader, WireLimits, encode_hello
from kvtier.protocol.gen import kvtier_pb2 as pb
from kvtier.protocol.gen import kvtier_pb2_grpc as pb_grpc
from kvtier.protocol.socket_io import read_frame, send_all
from kvtier.server.auth import parse_tokens
from kvtier.tiers.base import ABSENT, NODE_DOWN, Entry, Miss
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

ALICE, BOB, ROOT_TOKEN = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef", "root-token-0123456789abcdef"
QUOTA = 1 << 20
SLOT = 64 << 10


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("auth")
    tokens = work / "tokens"
    tokens.write_text(f"# token tenant [quota] [admin]\n{ALICE} alice 1MiB\n{BOB} bob\n"
                      f"{ROOT_TOKEN} ops admin\n")
    tokens.chmod(0o600)
    s = start_server(work, "--tokens-file", str(tokens), "--slot-bytes", str(SLOT), "--cpu-bytes", "24MiB")
    yield s
    assert s.stop() == 0, s.log


def stub_for(server: ServerProc) -> Iterator[pb_grpc.KVTierStub]:
    with grpc.insecure_channel(server.address) as ch:
        yield pb_grpc.KVTierStub(ch)


@pytest.fixture(scope="module")
def stub(server: ServerProc) -> Iterator[pb_grpc.KVTierStub]:
    yield from stub_for(server)


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value.code()  # type: ignore[no-any-return, attr-defined]


def tier(server: ServerProc, token: str, **kw: object) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(enabled=True, nodes=(server.address,), token=token, **kw))  # type: ignore[arg-type]


def test_every_rpc_needs_a_valid_token(stub: pb_grpc.KVTierStub) -> None:
    key = make_keys(1, seed=20)[0]
    calls = {
        "Info": lambda m: stub.Info(pb.InfoRequest(), metadata=m, timeout=5),
        "Lookup": lambda m: stub.Lookup(pb.LookupRequest(keys=[key]), metadata=m, timeout=5),
        "Get": lambda m: list(stub.Get(pb.GetRequest(keys=[key]), metadata=m, timeout=5)),
        "Put": lambda m: stub.Put(iter([pb.PutRequest(items=[pb.PutItem(key=key, chunk=make_chunk(key))])]),
                                  metadata=m, timeout=5),
        "Delete": lambda m: stub.Delete(pb.DeleteRequest(keys=[key]), metadata=m, timeout=5),
        "Stats": lambda m: stub.Stats(pb.StatsRequest(), metadata=m, timeout=5),
    }
    for name, call in calls.items():
        for bad in ((), md("wrong-token-0123456789abcdef"), (("authorization", "Basic xyz"),)):
            assert code_of(lambda c=call, b=bad: c(b)) == grpc.StatusCode.UNAUTHENTICATED, (name, bad)
        call(md(ALICE))  # and the same call with a valid token works
    assert stub.Info(pb.InfoRequest(), metadata=md(BOB), timeout=5).tenant == "bob"


def test_health_needs_no_token(server: ServerProc) -> None:
    with grpc.insecure_channel(server.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_tenants_cannot_read_probe_or_delete_each_other(server: ServerProc) -> None:
    alice, bob = tier(server, ALICE), tier(server, BOB)
    try:
        keys = make_keys(3, seed=21)
        chunks = [make_chunk(k, 4000, i) for i, k in enumerate(keys)]
        assert alice.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 3
        assert bob.probe(keys).hits == 0
        assert bob.get(keys) == [Miss(ABSENT)] * 3  # data path
        outs = [memoryview(bytearray(8192)) for _ in keys]
        assert bob.get_into(keys, outs) == [Miss(ABSENT)] * 3
        assert bob.delete(keys) == 0
        assert alice.get(keys) == chunks  # untouched by bob's attempts
        # bob writes the same key: two namespaces, two values.
        mine = make_chunk(keys[0], 4000, 99)
        assert bob.put([Entry(keys[0], mine)]) == [True]
        assert bob.get(keys[:1]) == [mine] and alice.get(keys[:1]) == chunks[:1]
        assert bob.delete(keys[:1]) == 1 and alice.get(keys[:1]) == chunks[:1]
    finally:
        alice.close()
        bob.close()


def test_cross_tenant_stats_is_admin_only(stub: pb_grpc.KVTierStub) -> None:
    for wanted in ("alice", "*"):
        assert code_of(lambda w=wanted: stub.Stats(pb.StatsRequest(tenant=w), metadata=md(BOB), timeout=5)) \
            == grpc.StatusCode.PERMISSION_DENIED
    own = stub.Stats(pb.StatsRequest(tenant="bob"), metadata=md(BOB), timeout=5)
    assert [t.tenant for t in own.tenants] == ["bob"]
    every = stub.Stats(pb.StatsRequest(tenant="*"), metadata=md(ROOT_TOKEN), timeout=5)
    assert sorted(t.tenant for t in every.tenants) == ["alice", "bob", "ops"]
    one = stub.Stats(pb.StatsRequest(tenant="alice"), metadata=md(ROOT_TOKEN), timeout=5)
    assert one.tenants[0].quota_bytes == QUOTA
    assert code_of(lambda: stub.Stats(pb.StatsRequest(tenant="nobody"), metadata=md(ROOT_TOKEN), timeout=5)) \
        == grpc.StatusCode.NOT_FOUND


def test_data_path_needs_a_valid_token(server: ServerProc) -> None:
    limits = WireLimits()
    for token in ("", "wrong-token-0123456789abcdef"):
        with socket.create_connection(("127.0.0.1", server.ports["data"]), timeout=5) as sock:
            send_all(sock, encode_hello(token))
            frame = read_frame(sock, FrameReader(limits))
            assert frame.type == ERROR and frame.header.count == grpc.StatusCode.UNAUTHENTICATED.value[0]
            assert sock.recv(1) == b""  # and the server hangs up


def test_quota_evicts_within_the_tenant_only(server: ServerProc, stub: pb_grpc.KVTierStub) -> None:
    alice, bob = tier(server, ALICE), tier(server, BOB)
    try:
        bob_keys = make_keys(6, seed=22)
        bob_chunks = [make_chunk(k, 50_000, i) for i, k in enumerate(bob_keys)]
        assert bob.put([Entry(k, c) for k, c in zip(bob_keys, bob_chunks)]) == [True] * 6
        keys = make_keys(40, seed=23)  # 40 x ~50 KB in 64 KiB slots: 2.5x alice's 1 MiB quota
        chunks = [make_chunk(k, 50_000, i) for i, k in enumerate(keys)]
        for i, (k, c) in enumerate(zip(keys, chunks)):
            assert alice.put([Entry(k, c, depth=i)]) == [True]  # a full tenant evicts, never refuses
        got = alice.get(keys)
        held = [i for i, g in enumerate(got) if not isinstance(g, Miss)]
        assert 0 < len(held) <= QUOTA // SLOT < 40
        assert held == list(range(40 - len(held), 40))  # LRU: the newest survive
        assert all(got[i] == chunks[i] for i in held)
        assert {g.reason for g in got if isinstance(g, Miss)} == {"evicted"}
        stats = stub.Stats(pb.StatsRequest(), metadata=md(ALICE), timeout=5).tenants[0]
        assert stats.used_bytes <= stats.quota_bytes == QUOTA and stats.evictions >= 40 - len(held)
        assert bob.get(bob_keys) == bob_chunks  # the other tenant lost nothing
        assert stub.Stats(pb.StatsRequest(), metadata=md(BOB), timeout=5).tenants[0].evictions == 0
    finally:
        alice.close()
        bob.close()


def test_tokens_file_format_errors() -> None:
    assert parse_tokens("tok-0123456789abcdef t1 2GiB admin\n")["tok-0123456789abcdef"].quota_bytes == 2 << 30
    assert parse_tokens("tok-0123456789abcdef t1 1MiB\n")["tok-0123456789abcdef"].quota_bytes == 1 << 20
    with pytest.raises(ConfigError, match="quota 64KiB is under 1MiB"):
        parse_tokens("tok-0123456789abcdef t1 64KiB\n")
    # "#" inside a token is part of it; only "#" at a line start or after a space is a comment
    assert parse_tokens("tok#0123456789abcdef t1 # note\n  # whole line\n") == {
        "tok#0123456789abcdef": parse_tokens("x" * 16 + " t1")["x" * 16]}
    for bad in ("short t1", "tok-0123456789abcdef", "tok-0123456789abcdef ../x", "tok-0123456789abcdef .x",
                "tok-0123456789abcdef t1 lots", "tok-0123456789abcdef t1\ntok-0123456789abcdef t2",
                "tok-0123456789abcdef t1 1GiB\ntok-0123456789abcdeX t1 2GiB",
                "tok-0123456789abcdef t1 64KiB", "tok-0123456789abcdef t1 1048575"):  # unenforceable quotas
        with pytest.raises(ConfigError):
            parse_tokens(bad)


# --- TLS ---------------------------------------------------------------------------------------
def _cert(subject: str, issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None, *, ca: bool,
          san: bool = False) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(name)
               .issuer_name(issuer[0].subject if issuer else name).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    path.with_suffix(".pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return str(path.with_suffix(".pem")), str(path.with_suffix(".key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("kvtier test CA", None, ca=True)
    other_ca = _cert("some other CA", None, ca=True)
    files = {"ca": _write(d / "ca", *ca)[0]}
    files["server_cert"], files["server_key"] = _write(d / "server", *_cert("server", ca, ca=False, san=True))
    files["client_cert"], files["client_key"] = _write(d / "client", *_cert("client", ca, ca=False))
    files["rogue_cert"], files["rogue_key"] = _write(d / "rogue", *_cert("rogue", other_ca, ca=False))
    return files


def _round_trip(t: GrpcTier, seed: int) -> None:
    keys = make_keys(2, seed=seed)
    chunks = [make_chunk(k, 3000, i) for i, k in enumerate(keys)]
    assert t.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True, True]
    assert t.get(keys) == chunks
    assert t.probe(keys).hits == 2


def test_tls_on_grpc_and_data_path(tmp_path: Path, pki: dict[str, str]) -> None:
    # TLS makes a non-loopback address acceptable without --allow-insecure-remote.
    s = start_server(tmp_path, "--host", "0.0.0.0", "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"])
    try:
        for seed, path in enumerate(("auto", "socket", "grpc"), 30):
            t = tier(s, "", tls_ca=pki["ca"], data_path=path, timeout_s=5)
            try:
                data = t.nodes[0].data
                assert (data.kind if data else "grpc") == {"auto": "shm"}.get(path, path)
                _round_trip(t, seed=seed)
            finally:
                t.close()
        plain = tier(s, "", timeout_s=1)  # no TLS on the client: the node is unusable
        try:
            assert plain.get(make_keys(1, seed=30)) == [Miss(NODE_DOWN)]
        finally:
            plain.close()
    finally:
        assert s.stop() == 0, s.log


def test_mutual_tls(tmp_path: Path, pki: dict[str, str]) -> None:
    s = start_server(tmp_path, "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                     "--tls-client-ca", pki["ca"])
    try:
        good = tier(s, "", tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"], timeout_s=5)
        try:
            assert good.nodes[0].data is not None
            _round_trip(good, seed=32)
        finally:
            good.close()
        for cert, key in (("", ""), (pki["rogue_cert"], pki["rogue_key"])):
            bad = tier(s, "", tls_ca=pki["ca"], tls_cert=cert, tls_key=key, timeout_s=1)
            try:
                assert bad.get(make_keys(1, seed=32)) == [Miss(NODE_DOWN)]
            finally:
                bad.close()
    finally:
        assert s.stop() == 0, s.log


def test_tls_handshake_has_a_hard_deadline(tmp_path: Path, pki: dict[str, str]) -> None:
    """Issue 10 item 2 under TLS: a peer trickling its ClientHello a byte at a time is cut off
    at handshake_timeout_s (the reaper shuts the descriptor down mid-handshake); a real TLS
    client still gets through afterwards."""
    s = start_server(tmp_path, "--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                     "--set", "handshake_timeout_s=1")
    try:
        with socket.create_connection(("127.0.0.1", s.ports["data"]), timeout=10) as sock:
            start = time.monotonic()
            hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64
            cut = None
            for b in hello:
                try:
                    sock.send(bytes([b]))
                except (BrokenPipeError, ConnectionResetError):
                    cut = time.monotonic() - start
                    break
                time.sleep(0.2)
            assert cut is not None and cut < 3.0, cut
        t = tier(s, "", tls_ca=pki["ca"], data_path="socket", timeout_s=5)
        try:
            _round_trip(t, seed=40)
        finally:
            t.close()
    finally:
        assert s.stop() == 0, s.log

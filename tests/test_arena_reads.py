"""Arena reads (kvtier.server.arena_refs): a same-host client maps its tenant's RAM arena
read-only and GET replies name where each chunk lies, so the client's copy is the only one.

What must hold, each checked against a real kvtier-server or a real memfd arena:
- the bytes are right on every read path (get, get_into, get_visit), and the server's own
  counters say they went out by reference (``path="arena"``), not through the segment;
- a slot a reply named is held: the key overwritten, deleted and its slot wanted by a flood of
  puts from another connection, the client still reads the old chunk until its next request
  (the control, at the tier: the same churn without the hold rewrites that slot);
- the client can neither write nor resize the arena (read-only descriptor, sealed size), at
  the tier and as a hostile client takes the descriptor from the hand-off;
- a client claiming in SHM_MAPPED an arena it was not offered still gets segment references;
- a tenant's mapping holds no byte another tenant stored;
- a server with huge pages or ``arena_reads: false`` offers no arena and GETs use the segment;
- the wire: the offer, SHM_MAPPED's bits, ARENA references, and ARENA anywhere else refused.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, GrpcTierConfig
from kvtier.protocol.frames import (
    CHUNK,
    PUT,
    PUT_REPLY,
    SHM_READY,
    Buffers,
    Frame,
    FrameReader,
    ProtocolError,
    ShmOffer,
    ShmRef,
    WireLimits,
    encode_chunk_ref,
    encode_header,
    encode_hello,
    encode_put,
    encode_shm_mapped,
    encode_shm_ready,
    parse_shm_ready,
)
from kvtier.protocol.session import GetReplyCollector, ServerSession
from kvtier.protocol.socket_io import read_frame, send_all
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.remote import GrpcTier
from kvtier.tiers.remote.data_conn import DataConn
from tests.hostile_client import ALICE, BOB, assert_shm_get, connect, fetch_fds, offer_segment
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

PAYLOAD = 60_000  # payload bytes: chunks of ~60 KiB in 64 KiB slots


def _out_bytes(server: ServerProc) -> dict[str, float]:
    out = {}
    for line in server.metrics().splitlines():
        if line.startswith("kvtier_server_chunk_bytes_total{") and 'direction="out"' in line:
            labels, value = line.rsplit(" ", 1)
            out[labels.split('path="')[1].split('"')[0]] = float(value)
    return out


@pytest.fixture(scope="module", name="server")
def two_tenant_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    work = tmp_path_factory.mktemp("arena")
    (work / "tokens").write_text(f"{ALICE} alice\n{BOB} bob\n")
    (work / "tokens").chmod(0o600)
    s = start_server(work, "--tokens-file", str(work / "tokens"), "--cpu-bytes", "8MiB", "--slot-bytes", "64KiB",
                     "--set", "shm_bytes=1MiB", "--set", "max_chunk_bytes=64KiB")
    yield s
    assert s.alive() and s.stop() == 0, s.log
    assert "Traceback" not in s.log, s.log


def _tier(server: ServerProc, token: str) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(enabled=True, nodes=(server.address,), token=token, data_path="shm"))


def _conn(tier: GrpcTier) -> DataConn:
    data = tier.nodes[0].data
    assert data is not None
    return data.connect(time.monotonic() + 10)


def test_every_read_path_copies_straight_from_the_arena(server: ServerProc) -> None:
    tier = _tier(server, ALICE)
    try:
        keys = make_keys(12, seed=1)
        chunks = [make_chunk(k, PAYLOAD, seed=i) for i, k in enumerate(keys)]
        before = _out_bytes(server)
        assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 12
        assert tier.get(keys) == chunks
        outs = [memoryview(bytearray(64 << 10)) for _ in keys]
        assert tier.get_into(keys, outs) == [len(c) for c in chunks]
        assert [bytes(o[: len(c)]) for o, c in zip(outs, chunks)] == chunks
        seen: dict[int, bytes] = {}
        assert tier.get_visit(keys, lambda i, v: seen.__setitem__(i, bytes(v))) == [len(c) for c in chunks]
        assert seen == dict(enumerate(chunks))
        missing = make_keys(1, seed=2)
        assert isinstance(tier.get(missing)[0], Miss)
        after = _out_bytes(server)
        grew = {p: after.get(p, 0) - before.get(p, 0) for p in after}
        assert grew["arena"] == 3 * sum(map(len, chunks)), grew
        assert grew.get("shm", 0) == 0 and grew.get("socket", 0) == 0, grew
    finally:
        tier.close()


def test_a_named_slot_stays_intact_until_the_next_request(server: ServerProc) -> None:
    reader, writer = _tier(server, ALICE), _tier(server, ALICE)
    try:
        key = make_keys(1, seed=3)[0]
        old = make_chunk(key, PAYLOAD, seed=30)
        assert reader.put([Entry(key, old)]) == [True]
        churn = make_keys(200, seed=4)  # 200 x 64 KiB slots: 1.5x alice's RAM, every free slot taken
        seen: list[bytes] = []

        def visit(i: int, view: memoryview) -> None:
            new = make_chunk(key, PAYLOAD, seed=31)
            assert writer.put([Entry(key, new)]) == [True]  # overwritten ...
            writer.delete([key])  # ... deleted ...
            for j in range(0, len(churn), 20):  # ... and the RAM recycled many times over
                writer.put([Entry(k, make_chunk(k, PAYLOAD, seed=j)) for k in churn[j : j + 20]])
            seen.append(bytes(view))

        assert reader.get_visit([key], visit) == [len(old)]
        assert seen == [old]
        assert isinstance(reader.get([key])[0], Miss)  # the hold ended with that request
    finally:
        reader.close()
        writer.close()


def test_the_hold_is_what_keeps_the_slot_the_control() -> None:
    """The same churn at the tier: without a hold the slot that held the chunk is rewritten;
    with one it is not, and it is reused once released."""
    tier = CpuTier(CpuTierConfig(capacity_bytes=8 * 4096, slot_bytes=4096, pin_memory="never"),
                   lazy=True, shareable=True)
    arena = memoryview(tier._arena)
    key, others = make_keys(1, seed=5)[0], make_keys(40, seed=6)
    old = make_chunk(key, 3000, seed=50)

    def churn() -> None:
        tier.delete([key])
        for j, k in enumerate(others):
            tier.put([Entry(k, make_chunk(k, 3000, seed=j))])

    for held in (False, True):
        assert tier.put([Entry(key, old)]) == [True]
        ((slot, offset, length),) = tier.hold([key])  # type: ignore[misc]
        if not held:
            tier.release([slot])
        churn()
        assert (bytes(arena[offset : offset + length]) == old) is held
        if held:
            tier.release([slot])
            churn()
            assert bytes(arena[offset : offset + length]) != old
    assert tier.check() == []
    tier.close()


def test_the_client_can_neither_write_nor_resize_the_arena() -> None:
    tier = CpuTier(CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=64 << 10, pin_memory="never"),
                   lazy=True, shareable=True)
    fd = tier.reader_fd()
    try:
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 1 << 20)  # shared + writable: refused for an O_RDONLY descriptor
        with pytest.raises(OSError):
            os.write(fd, b"x")
        with pytest.raises(OSError):
            os.ftruncate(fd, 0)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        view = mmap.mmap(fd, 1 << 20, prot=mmap.PROT_READ)
        key = make_keys(1, seed=7)[0]
        chunk = make_chunk(key, 5000, seed=70)
        assert tier.put([Entry(key, chunk)]) == [True]
        ((slot, offset, length),) = tier.hold([key])  # type: ignore[misc]
        assert view[offset : offset + length] == chunk  # another mapping sees the stored bytes
        tier.release([slot])
        view.close()
    finally:
        os.close(fd)
        tier.close()
    with pytest.raises(ValueError, match="not shareable"):
        CpuTier(CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=64 << 10, pin_memory="never"), lazy=True).reader_fd()


def test_a_tenant_maps_only_its_own_arena(server: ServerProc) -> None:
    alice, bob = _tier(server, ALICE), _tier(server, BOB)
    try:
        key = make_keys(1, seed=9)[0]
        chunk = make_chunk(key, PAYLOAD, seed=90)  # random payload: its bytes occur nowhere else
        assert alice.put([Entry(key, chunk)]) == [True]
        mine, theirs = _conn(alice), _conn(bob)
        try:
            assert mine.arena is not None and theirs.arena is not None
            probe = chunk[-4096:]
            assert probe in bytes(mine.arena)  # the control: alice's own mapping has it
            assert probe not in bytes(theirs.arena)
        finally:
            mine.close()
            theirs.close()
    finally:
        alice.close()
        bob.close()


@pytest.mark.parametrize("setting", ["cpu.huge_pages=true", "arena_reads=false"])
def test_without_a_shareable_arena_gets_use_the_segment(tmp_path: Path, setting: str) -> None:
    s = start_server(tmp_path, "--cpu-bytes", "8MiB", "--slot-bytes", "2MiB", "--set", setting)
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), data_path="shm"))
    try:
        conn = _conn(tier)
        assert conn.shm is not None and conn.arena is None
        conn.close()
        keys = make_keys(3, seed=10)
        chunks = [make_chunk(k, 100_000, seed=i) for i, k in enumerate(keys)]
        assert tier.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 3
        assert tier.get(keys) == chunks
        # The server counts a reply's bytes once it is sent, so the client can be back first.
        out, deadline = _out_bytes(s), time.monotonic() + 10
        while out.get("shm", 0) < sum(map(len, chunks)) and time.monotonic() < deadline:
            time.sleep(0.02)
            out = _out_bytes(s)
        assert out["shm"] == sum(map(len, chunks)) and out.get("arena", 0) == 0, out
    finally:
        tier.close()
        assert s.stop() == 0, s.log


def _reopens_for_writing(fd: int) -> bool:
    """Whether a process that is not root (uid nobody, where these tests run as root) holding
    ``fd`` can reopen it read-write through /proc: a memfd is created 0777, so the read-only
    descriptor alone did not stop it (the client could rewrite stored, verified chunks)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            if os.getuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            os.close(os.open(f"/proc/self/fd/{fd}", os.O_RDWR))
            os._exit(0)
        except OSError:
            os._exit(1)
    return os.waitpid(pid, 0)[1] == 0


def test_the_arena_descriptor_a_client_receives_is_read_only(server: ServerProc) -> None:
    """Straight from the hand-off, as a hostile client would take it: the second descriptor
    maps for reading only and cannot be resized."""
    sock, reader = connect(server, ALICE)
    with sock:
        offer = offer_segment(sock, reader)
        assert offer.arena_size > 0
        fds = fetch_fds(offer)
        assert len(fds) == 2
        seg_fd, arena_fd = fds
        try:
            with pytest.raises(PermissionError):
                mmap.mmap(arena_fd, offer.arena_size)
            for size in (0, offer.arena_size * 2):
                with pytest.raises(OSError):
                    os.ftruncate(arena_fd, size)
            with pytest.raises(OSError):
                os.write(arena_fd, b"x")
            mmap.mmap(arena_fd, offer.arena_size, prot=mmap.PROT_READ).close()
            assert stat.S_IMODE(os.fstat(arena_fd).st_mode) == 0o400
            assert not _reopens_for_writing(arena_fd)
        finally:
            os.close(seg_fd)
            os.close(arena_fd)
        send_all(sock, encode_shm_mapped(False))
    assert server.alive()


def test_a_client_claiming_an_arena_it_was_not_offered_gets_segment_references(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text(f"{ALICE} alice\n")
    (tmp_path / "tokens").chmod(0o600)
    s = start_server(tmp_path, "--tokens-file", str(tmp_path / "tokens"), "--set", "arena_reads=false")
    try:
        sock, reader = connect(s, ALICE)
        with sock:
            offer = offer_segment(sock, reader)
            assert offer.arena_size == 0
            fds = fetch_fds(offer)
            assert len(fds) == 1
            seg = mmap.mmap(fds[0], offer.size)
            os.close(fds[0])
            send_all(sock, encode_shm_mapped(True, arena=True))  # a lie: no arena was offered
            key = make_keys(1, seed=11)[0]
            chunk = make_chunk(key, 5000, seed=110)
            send_all(sock, encode_put(key, chunk))
            assert read_frame(sock, reader).type == PUT_REPLY
            assert_shm_get(sock, reader, seg, [key], [chunk])  # segment references, never ARENA
            seg.close()
        assert s.alive()
    finally:
        assert s.stop() == 0, s.log


def test_no_memfd_means_a_private_arena_not_a_failed_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that refuses memfd_create (a seccomp filter) still gets a working RAM tier."""
    def refuse(*args: object) -> int:
        raise PermissionError(1, "memfd_create blocked")

    monkeypatch.setattr(os, "memfd_create", refuse)
    tier = CpuTier(CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=64 << 10, pin_memory="never"),
                   lazy=True, shareable=True)
    assert not tier.shared
    key = make_keys(1, seed=12)[0]
    chunk = make_chunk(key, 5000, seed=120)
    assert tier.put([Entry(key, chunk)]) == [True] and tier.get([key]) == [chunk]
    tier.delete([key])  # frees the slot's pages the private way (MADV_DONTNEED)
    assert tier.check() == []
    tier.close()


def test_a_process_maps_each_arena_once(server: ServerProc) -> None:
    """Connections of one process to the same tenant's arena share one mapping (page tables
    are per mapping); another tenant's is its own; the last connection to go unmaps it."""
    from kvtier.tiers.remote import shm_map

    alice, bob = _tier(server, ALICE), _tier(server, BOB)
    try:
        a1, a2, b1 = _conn(alice), _conn(alice), _conn(bob)
        assert a1._arena_map is not None and a1._arena_map is a2._arena_map
        assert b1._arena_map is not None and b1._arena_map is not a1._arena_map
        mapping = a1._arena_map
        a1.close()
        key = make_keys(1, seed=13)[0]
        chunk = make_chunk(key, PAYLOAD, seed=130)
        assert alice.put([Entry(key, chunk)]) == [True]
        assert chunk[-4096:] in bytes(mapping)  # still mapped for a2 (and alice's pooled connection)
        a2.close()
        b1.close()
    finally:
        alice.close()
        bob.close()
    assert all(known is not mapping for known, _ in shm_map._arenas.values())
    assert mapping.closed


def _decode(data: bytes | Buffers) -> list[Frame]:
    """The frames in ``data`` (bytes, or an encoder's buffers)."""
    raw = data if isinstance(data, bytes) else b"".join(bytes(part) for part in data)
    return FrameReader(WireLimits()).feed(raw)


def test_arena_references() -> None:
    """The arena (kvtier.server.arena_refs): offered in SHM_READY, acknowledged in SHM_MAPPED's
    bits, referenced by CHUNKs with SHM | ARENA and by nothing else."""
    offer = ShmOffer("kvtier-shm-ab", "t" * 32, 1 << 20, 64 << 20)
    assert parse_shm_ready(_decode((encode_shm_ready(offer)))[0]) == offer
    plain = ShmOffer("kvtier-shm-ab", "t" * 32, 1 << 20)
    assert parse_shm_ready(_decode((encode_shm_ready(plain)))[0]).arena_size == 0  # older servers
    for bad in (-1, True, "1", 1.5):
        body = json.dumps({"socket": "x", "ticket": "t", "size": 1, "arena": bad}).encode()
        with pytest.raises(ProtocolError, match="arena size"):
            parse_shm_ready(_decode(encode_header(SHM_READY, 0, 0, len(body)) + body)[0])
    assert [_decode((encode_shm_mapped(*a)))[0].header.count
            for a in ((True, True), (True, False), (False, True), (False, False))] == [3, 1, 0, 0]
    c = GetReplyCollector(2)
    c.accept(_decode((encode_chunk_ref(0, 64, 100, arena=True)))[0])
    c.accept(_decode((encode_chunk_ref(1, 64, 100)))[0])
    assert c.results == [ShmRef(64, 100, arena=True), ShmRef(64, 100)]
    with pytest.raises(ProtocolError, match="ARENA flag but not SHM"):
        GetReplyCollector(1).accept(_decode(encode_header(CHUNK, 8, 0, 3) + b"abc")[0])
    key = make_keys(1, seed=4)[0]
    session = ServerSession(WireLimits())
    session.accept(_decode((encode_hello("")))[0])
    for flags in (8, 8 | 4):  # a PUT never references the arena
        body = key + bytes(16)
        with pytest.raises(ProtocolError, match="ARENA flag"):
            session.accept(_decode(encode_header(PUT, flags, 0, len(body)) + body)[0])

"""Tenant quotas are caps on one shared budget per medium (issue 10, "Tenant memory"): a busy
tenant uses the capacity an idle one leaves, and a quiet tenant's chunks survive a noisy
tenant's flood up to the quiet tenant's guaranteed share. Real kvtier-servers with a disk tier
and RAM only (the server's RSS measured), and the storage layer directly for promotions."""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, DiskTierConfig, GrpcTierConfig
from kvtier.server.auth import Tenant
from kvtier.server.storage import Storage
from kvtier.tiers.base import Entry, Miss
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ServerProc, make_chunk, make_keys, start_server

MiB = 1 << 20
BUSY = "busy-token-0123456789abcdef"
QUIET = "quiet-token-0123456789abcdef"
CHUNK = 60_000  # ~15 chunks per MiB on disk (4 KiB aligned)


def disk_used(server: ServerProc) -> dict[str, int]:
    with urllib.request.urlopen(server.http + "/api/stats", timeout=10) as r:
        doc = json.loads(r.read())
    return {t["tenant"]: next(x["used_bytes"] for x in t["tiers"] if x["name"] == "disk") for t in doc["tenants"]}


def put_all(tier: GrpcTier, keys: list[bytes], seed: int) -> None:
    for i in range(0, len(keys), 8):
        batch = keys[i : i + 8]
        assert tier.put([Entry(k, make_chunk(k, CHUNK, seed=seed)) for k in batch]) == [True] * len(batch)


def test_busy_tenant_uses_idle_capacity_and_quiet_share_survives(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{BUSY} busy\n{QUIET} quiet\n")
    tokens.chmod(0o600)
    # 8 MiB of disk for two tenants: a guaranteed share of 4 MiB each, the rest shared. RAM is
    # 1 MiB per tenant, so it cannot hide what the disk holds.
    s = start_server(tmp_path, "--tokens-file", str(tokens), "--disk-dir", "disk", "--disk-bytes", "8MiB",
                     "--cpu-bytes", "2MiB", "--slot-bytes", "64KiB", "--set", "max_chunk_bytes=64KiB")
    busy = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), token=BUSY))
    quiet = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), token=QUIET))
    try:
        busy_keys = make_keys(100, seed=1)  # ~6 MiB: more than its 4 MiB share
        put_all(busy, busy_keys, seed=1)
        used = disk_used(s)
        assert used["busy"] > 5 * MiB and used["quiet"] == 0, used  # the idle share is used
        held = busy.get(busy_keys)
        assert sum(not isinstance(v, Miss) for v in held) == len(busy_keys)

        quiet_keys = make_keys(50, seed=2)  # ~3 MiB: within its share
        put_all(quiet, quiet_keys, seed=2)
        flood = make_keys(400, seed=3)  # ~24 MiB from the noisy tenant
        put_all(busy, flood, seed=3)
        used = disk_used(s)
        assert sum(used.values()) <= 8 * MiB + 8 * 64 * 1024, used  # the budget (+ one batch in flight)
        got = quiet.get(quiet_keys)
        assert got == [make_chunk(k, CHUNK, seed=2) for k in quiet_keys]  # every quiet chunk survived
        assert used["quiet"] >= len(quiet_keys) * CHUNK, used  # on disk, not only cached in RAM
    finally:
        busy.close()
        quiet.close()
        assert s.stop() == 0, s.log


def ram_used(server: ServerProc) -> dict[str, int]:
    """Each tenant's RAM chunk bytes, what the RAM budget counts (/metrics: /api/stats's
    used_bytes counts whole slots, what each tenant's own tier counts)."""
    with urllib.request.urlopen(server.http + "/api/stats", timeout=10) as r:
        tenants = [t["tenant"] for t in json.loads(r.read())["tenants"]]
    found = dict(re.findall(r'^kvtier_server_tier_chunk_bytes\{tenant="([^"]+)",tier="cpu"\} (\S+)$',
                            server.metrics(), re.M))
    return {t: int(float(found[t])) for t in tenants}


def rss(server: ServerProc) -> int:
    """The server process's resident bytes, from /proc (measured, not assumed)."""
    for line in Path(f"/proc/{server.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def warm_bytes(server: ServerProc) -> int:
    """Free RAM slot bytes the warm-ahead thread keeps faulted in, once it has settled."""
    last = -1
    for _ in range(200):
        line = next(x for x in server.metrics().splitlines() if x.startswith("kvtier_server_ram_warm_bytes "))
        now = int(float(line.split()[-1]))
        if now == last:
            return now
        last = now
        time.sleep(0.05)
    raise AssertionError("kvtier_server_ram_warm_bytes never settled")


def test_ram_only_server_shares_its_ram_budget(tmp_path: Path) -> None:
    """RAM-only (the default kvtier-server): the same caps-on-a-pool semantics for RAM, and
    the process's resident memory stays within the RAM budget (+ slack) however the tenants
    move it around: freed slots' pages go back to the OS, and the slots the warm-ahead
    thread keeps faulted in for the puts to come (here the whole budget while it is free)
    count within the budget, not beside it."""
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{BUSY} busy\n{QUIET} quiet\n")
    tokens.chmod(0o600)
    budget = 48 * MiB  # a guaranteed share of 24 MiB each, the rest shared
    # No shared-memory segments (each data connection's is bounded on its own, outside the
    # quotas): the process's RSS is then the arenas plus the interpreter.
    s = start_server(tmp_path, "--tokens-file", str(tokens), "--cpu-bytes", "48MiB",
                     "--slot-bytes", "64KiB", "--set", "max_chunk_bytes=64KiB", "--set", "shm_bytes=0")
    busy = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), token=BUSY))
    quiet = GrpcTier(GrpcTierConfig(enabled=True, nodes=(s.address,), token=QUIET))
    try:
        put_all(busy, make_keys(8, seed=9), seed=9)  # warm the request paths up
        warm = warm_bytes(s)
        assert warm >= 32 * MiB  # the free budget, faulted in ahead of the puts
        base = rss(s) - warm  # the interpreter and the request paths: growth is chunks + warm slots
        busy_keys = make_keys(750, seed=1)  # ~43 MiB: far beyond its 24 MiB share
        put_all(busy, busy_keys, seed=1)
        used = ram_used(s)
        assert used["busy"] > 40 * MiB and used["quiet"] == 0, used  # the idle share is used
        held = busy.get(busy_keys)
        assert sum(not isinstance(v, Miss) for v in held) >= len(busy_keys) - 8
        peak = rss(s)

        quiet_keys = make_keys(360, seed=2)  # ~21 MiB: within its share; busy must give way
        put_all(quiet, quiet_keys, seed=2)
        peak = max(peak, rss(s))
        flood = make_keys(1200, seed=3)  # ~69 MiB from the noisy tenant
        put_all(busy, flood, seed=3)
        used = ram_used(s)
        assert sum(used.values()) <= budget + 8 * CHUNK, used  # the budget (+ one batch in flight)
        got = quiet.get(quiet_keys)
        assert got == [make_chunk(k, CHUNK, seed=2) for k in quiet_keys]  # every quiet chunk survived
        peak = max(peak, rss(s))
        grown = peak - base
        print(f"server RSS: base {base / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB, "
              f"grown {grown / MiB:.1f} MiB for a {budget / MiB:.0f} MiB RAM budget")
        # Without pages going back, busy's 43 MiB of touched slots + quiet's 21 MiB = 64 MiB.
        assert grown <= budget + 8 * MiB, (base, peak)
        assert s.alive()
    finally:
        busy.close()
        quiet.close()
        assert s.stop() == 0, s.log


def test_promotions_from_disk_make_room_in_the_ram_pool(tmp_path: Path) -> None:
    """With a disk tier RAM is a cache, shared the same way: a busy tenant's writes and its
    disk hits promoted into RAM (get and get_into) use idle RAM but never the quiet tenant's
    share, and the tenants together stay within the RAM budget."""
    budget = 4 * MiB  # 2 MiB guaranteed per tenant
    storage = Storage([Tenant("busy"), Tenant("quiet")], CpuTierConfig(capacity_bytes=budget, slot_bytes=64 << 10),
                      DiskTierConfig(enabled=True, path=str(tmp_path / "disk"), capacity_bytes=64 * MiB))
    busy, quiet = storage.store("busy"), storage.store("quiet")
    assert busy.ram is not None and quiet.ram is not None

    def ram_total() -> int:
        return sum(s.ram.usage().chunk_bytes for s in (busy, quiet) if s.ram is not None)

    try:
        busy_keys = make_keys(50, seed=1)  # ~2.9 MiB: beyond its RAM share, within the budget
        assert busy.put([Entry(k, make_chunk(k, CHUNK, seed=1)) for k in busy_keys]) == [True] * 50
        assert busy.ram.usage().chunk_bytes > 2.5 * MiB  # idle RAM is used
        quiet_keys = make_keys(24, seed=2)  # ~1.4 MiB: within its share; busy gives way
        assert quiet.put([Entry(k, make_chunk(k, CHUNK, seed=2)) for k in quiet_keys]) == [True] * 24
        flood = make_keys(200, seed=3)  # ~11 MiB: RAM keeps only the newest of it
        for i in range(0, len(flood), 8):
            batch = flood[i : i + 8]
            assert busy.put([Entry(k, make_chunk(k, CHUNK, seed=3)) for k in batch]) == [True] * len(batch)
            assert ram_total() <= budget + 8 * CHUNK
        # Reading the start of the flood back: disk hits, each batch promoted into RAM.
        for i in range(0, 96, 8):
            batch = flood[i : i + 8]
            if i % 16:
                outs = [memoryview(bytearray(CHUNK + 4096)) for _ in batch]
                got = busy.get_into(batch, outs)
                assert [bytes(o[:n]) for o, n in zip(outs, got) if isinstance(n, int)] == \
                    [make_chunk(k, CHUNK, seed=3) for k in batch]
            else:
                assert busy.get(batch) == [make_chunk(k, CHUNK, seed=3) for k in batch]
            assert busy.ram.probe(batch).hits == len(batch)  # promoted
            assert ram_total() <= budget + 8 * CHUNK
        assert quiet.ram.probe(quiet_keys).hits == len(quiet_keys)  # the quiet share survived
        assert storage.check() == []
    finally:
        storage.close()


def test_many_tenants_share_one_ram_budget_through_both_put_paths() -> None:
    """64 tenants on one RAM budget (no quotas: each may use it all, each is guaranteed 1/64).
    Scripted: tenants write in turn through both of the server's put paths, the data path's
    reservation (``reserve`` + ``commit``: taken only while the budget has room, never
    evicting) and ``put`` (which makes room), 40 chunks each, the later ones flooding the
    budget. After every write the tenants together stay within the budget (+ one chunk in
    flight), the pool's running view equals the tiers' own usage, and at the end every
    tenant still holds its guaranteed share's worth of its newest chunks. (Guaranteed shares
    once had a 1 MiB floor: here 64 x 1 MiB against a 16 MiB budget, and the tenants passed it.)"""
    n, chunk, per = 64, 60_000, 40
    slot = 64 << 10
    share_slots = 4
    budget = n * share_slots * slot  # 16 MiB: 4 slots guaranteed per tenant
    storage = Storage([Tenant(f"t{i}") for i in range(n)], CpuTierConfig(capacity_bytes=budget, slot_bytes=slot),
                      DiskTierConfig(enabled=False))
    stores = [storage.store(f"t{i}") for i in range(n)]
    pool = stores[0].ram_pool
    assert pool is not None
    keys = {i: make_keys(per, seed=100 + i) for i in range(n)}
    reserved = 0
    try:
        for j in range(per):
            for i, store in enumerate(stores):
                key = keys[i][j]
                data = make_chunk(key, chunk, seed=i)
                res = store.reserve(len(data)) if j % 2 else None
                if res is not None:
                    reserved += 1
                    res.view[:] = data
                    assert store.commit(res, Entry(key, res.view))
                else:
                    assert store.put([Entry(key, data)]) == [True]
                tiers_used = sum(s.ram.usage().chunk_bytes for s in stores if s.ram is not None)
                assert pool.used() == tiers_used
                assert tiers_used <= budget + chunk, (i, j, tiers_used)
        assert 0 < reserved < n * per // 2  # taken while there was room, refused once full
        for i, store in enumerate(stores):
            newest = keys[i][per - share_slots :]
            assert store.get(newest) == [make_chunk(k, chunk, seed=i) for k in newest], i
        assert storage.check() == []
    finally:
        storage.close()


def test_a_tenant_whose_ram_is_smaller_than_a_slot_is_told(caplog: pytest.LogCaptureFixture) -> None:
    """cpu.capacity_bytes (or a quota) below cpu.slot_bytes shrinks that tenant's slots: said
    in a warning naming the tenant and both sizes, not found later as refused puts."""
    caplog.set_level(logging.WARNING, logger="kvtier.server.storage")
    storage = Storage([Tenant("small", quota_bytes=MiB), Tenant("big")],
                      CpuTierConfig(capacity_bytes=16 * MiB, slot_bytes=4 * MiB), DiskTierConfig())
    try:
        assert storage.store("small").ram.slot_bytes == MiB  # type: ignore[union-attr]
        assert storage.store("big").ram.slot_bytes == 4 * MiB  # type: ignore[union-attr]
    finally:
        storage.close()
    warned = [r.getMessage() for r in caplog.records if "smaller than cpu.slot_bytes" in r.getMessage()]
    assert warned == ["tenant 'small': its RAM (1048576 bytes) is smaller than cpu.slot_bytes (4194304): "
                      "its slots shrink to 1048576 bytes and larger chunks are refused"]



def test_a_put_run_reserves_only_what_the_ram_budget_still_holds() -> None:
    """The data path's PUT runs reserve several RAM slots at once (TenantStore.reserve_many):
    never more than fit in what the shared RAM budget has left after every tenant's chunks
    (the run reads the budget once), never more than asked, and the slots go back whole."""
    slot = 64 << 10
    storage = Storage([Tenant("busy"), Tenant("quiet")], CpuTierConfig(capacity_bytes=16 * slot, slot_bytes=slot),
                      DiskTierConfig(enabled=False))
    busy, quiet = storage.store("busy"), storage.store("quiet")
    try:
        keys = make_keys(5, seed=4)
        chunks = [make_chunk(k, slot - 4096, seed=i) for i, k in enumerate(keys)]
        assert quiet.put([Entry(k, c) for k, c in zip(keys, chunks)]) == [True] * 5
        left = 16 * slot - sum(len(c) for c in chunks)  # what the budget still holds: 11 slots
        assert left // slot == 11
        run = busy.reserve_many(slot, 64)
        assert len(run) == 11  # the budget bounds it, not the tenant's own free slots
        for res in run:
            busy.abort(res)
        few = busy.reserve_many(slot, 3)
        assert len(few) == 3  # never more than asked
        for res in few:
            busy.abort(res)
        assert busy.reserve_many(slot + 1, 4) == []  # larger than a slot: the caller's copying path
        assert storage.check() == []
        assert quiet.get(keys) == chunks  # nothing the other tenant holds was touched
    finally:
        storage.close()


def test_a_tenant_at_its_cap_puts_through_spare_slots() -> None:
    """A tenant whose own RAM tier is full (its quota) still gets a reservation while the
    budget is full: a spare slot beyond its cap (kvtier.tiers.cpu, "Spare slots"), one per
    run at a time. An aborted one evicts nothing; a committed one evicts the tenant's own
    oldest chunk, never another tenant's, and the budget holds."""
    slot = 64 << 10
    storage = Storage([Tenant("capped", quota_bytes=32 * slot), Tenant("other")],
                      CpuTierConfig(capacity_bytes=64 * slot, slot_bytes=slot, policy="lru"),
                      DiskTierConfig(enabled=False))
    capped, other = storage.store("capped"), storage.store("other")
    pool = capped.ram_pool
    assert pool is not None and capped.ram is not None and capped.ram.spare_slots == 2
    try:
        mine, theirs = make_keys(33, seed=5), make_keys(32, seed=6)
        data = {k: make_chunk(k, slot - 128, seed=i) for i, k in enumerate(mine + theirs)}  # whole slots
        assert other.put([Entry(k, data[k]) for k in theirs]) == [True] * 32
        assert capped.put([Entry(k, data[k]) for k in mine[:32]]) == [True] * 32
        assert capped.ram.full and not pool.fits(slot)
        run = capped.reserve_many(slot, 8)
        assert len(run) == 1  # spares are shared by the tenant's connections
        capped.abort(run[0])
        assert capped.probe(mine[:32]).hits == 32  # nothing evicted for it
        res = capped.reserve(len(data[mine[32]]))
        assert res is not None
        res.view[:] = data[mine[32]]
        assert capped.commit(res, Entry(mine[32], res.view))
        assert capped.probe([mine[0]]).hits == 0 and capped.get(mine[1:]) == [data[k] for k in mine[1:]]
        assert other.get(theirs) == [data[k] for k in theirs]
        assert pool.used() <= 64 * slot and storage.check() == []
    finally:
        storage.close()

"""Tenant quotas are caps on one shared disk budget (issue 10, "Tenant memory"): a busy tenant
uses the capacity an idle one leaves, and a quiet tenant's chunks survive a noisy tenant's
flood up to the quiet tenant's guaranteed share. A real kvtier-server with a disk tier."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from kvtier.config import GrpcTierConfig
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

"""Figures the docs and the dashboards define, each checked by a real Prometheus over its own
small set of real kvtier-server nodes (tests/test_prometheus.py evaluates the whole Grafana
dashboard over a loaded cluster): the documented cluster formula for the engines'
prompt-token hit ratio, and the capacity panels where tenants' slots overfill the budget."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ROOT, make_chunk, make_keys, start_server
from tests.prometheus_server import (
    SCRAPE_S,
    dashboard_queries,
    needs_prometheus,
    resolve_variables,
    start_prometheus,
    substitute,
)
from tests.waiting import wait_for

pytestmark = needs_prometheus


def test_documented_engine_hit_ratio_counts_every_tier_once(tmp_path: Path) -> None:
    """docs/metrics.md's cluster formula for the engines' prompt-token hit ratio, evaluated by
    Prometheus over two real nodes that both receive one replica's usage reports (hits in two
    tiers). Taking the max over nodes without the ``tier`` label, as the docs said, kept only the
    busiest tier: 60 of 120 tokens instead of 90."""
    from kvtier.config import KVTierConfig
    from kvtier.usage.reporter import UsageReporter

    [formula] = re.findall(r"<!-- engine-hit-ratio -->\n`([^`]+)`", (ROOT / "docs" / "metrics.md").read_text())
    nodes = [start_server(tmp_path / f"u{i}", name=f"u{i}") for i in range(2)]
    prom = None
    cfg = KVTierConfig.from_dict({"grpc": {"enabled": True, "nodes": [n.address for n in nodes]},
                                  "usage": {"interval_s": 3600, "replica_id": "r1"}})
    reporter = UsageReporter(cfg, "m", "hf")
    try:
        prom = start_prometheus(tmp_path, {"kvtier-server": [n.http.removeprefix("http://") for n in nodes]})
        started = time.time()

        def scraped(prompt: int) -> bool:
            q = f"count(kvtier_server_engine_prompt_tokens_total == {prompt})"
            return bool(prom.query(q)) and prom.scalar(q) == 2

        for total in (120, 240, 360):  # the first report creates the series; rate() sees the next ones
            reporter.counters.record_lookup(120, {"cpu": 60, "grpc": 30}, "absent")
            assert reporter.send_now(5.0) == 2
            wait_for(f"both nodes scraped at {total} prompt tokens", lambda t=total: scraped(t), 30)
            time.sleep(SCRAPE_S * 1.5)
        window = f"{int(time.time() - started) + 5}s"
        ratio = prom.scalar(formula.replace("[5m]", f"[{window}]"))
        assert ratio == pytest.approx(0.75, rel=0.02)
    finally:
        reporter.close()
        if prom is not None:
            prom.proc.terminate()
            prom.proc.wait(20)
        for node in nodes:
            node.kill()


def test_capacity_used_counts_chunk_bytes_against_the_budget_that_counts_them(tmp_path: Path) -> None:
    """Three tenants (no quotas: each may fill the node's whole 2 MiB RAM budget) store
    ~4 KiB chunks in 64 KiB slots. The node's budget (kvtier.server.pool) counts chunk bytes,
    so it is far from full (nothing evicted); the slots held add up to 3 x 24 x 64 KiB =
    4.5 MiB. Dividing those slots by the 2 MiB budget, the capacity panels read 225 %: the
    node-level fraction must be the chunk bytes over the budget (and /api/cluster, which the
    HTML dashboard draws, must agree). One tenant selected, its own tier bounds it: slots
    over its capacity."""
    tenants = ("acme", "beta", "gamma")
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"fill-token-{t}-0123456789 {t}\n" for t in tenants))
    tokens.chmod(0o600)
    node = start_server(tmp_path / "n", "--tokens-file", str(tokens), "--cpu-bytes", "2MiB",
                        "--slot-bytes", "64KiB", name="n")
    prom = None
    try:
        for i, tenant in enumerate(tenants):
            tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(node.address,), token=f"fill-token-{tenant}-0123456789",
                                           timeout_s=5.0))
            try:
                keys = make_keys(24, seed=40 + i)
                assert all(tier.put([Entry(k, make_chunk(k, 4096, j), depth=j) for j, k in enumerate(keys)]))
            finally:
                tier.close()
        with urllib.request.urlopen(node.http + "/api/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
        budget = stats["capacity_bytes"]["cpu"]
        ram = {t["tenant"]: t["tiers"][0] for t in stats["tenants"]}
        assert budget == 2 << 20 and all(r["name"] == "cpu" and r["entries"] == 24 for r in ram.values())
        chunk_bytes = sum(r["chunk_bytes"] for r in ram.values())
        slot_bytes = sum(r["used_bytes"] for r in ram.values())
        assert slot_bytes == 3 * 24 * (64 << 10) > budget > 4 * chunk_bytes  # slots overfill it; chunks do not
        assert sum(t["evictions"] for t in stats["tenants"]) == 0  # the node never was full
        # The same figure from /metrics (the series the panels read): the truth, independently.
        text = node.metrics()
        assert sum(float(v) for v in re.findall(r'^kvtier_server_tier_chunk_bytes\{[^}]*tier="cpu"[^}]*\} (\S+)$',
                                                 text, re.M)) == chunk_bytes
        truth = chunk_bytes / budget

        prom = start_prometheus(tmp_path, {"kvtier-server": [node.http.removeprefix("http://")]})
        chunks_q = 'sum(kvtier_server_tier_chunk_bytes{tier="cpu"})'
        wait_for("the stored chunks scraped", lambda: prom.query(chunks_q) and prom.scalar(chunks_q) == chunk_bytes
              and prom.query("kvtier_server_requests_total"), 30)
        variables = resolve_variables(prom)
        assert variables["tenant"] == sorted(tenants)
        panels = {title: expr for title, expr in dashboard_queries()}
        overall = prom.scalar(substitute(panels["Capacity used"], variables, "1m"))
        [per_node] = prom.query(substitute(panels["Capacity per node and tier"], variables, "1m"))
        assert (overall, float(per_node["value"][1])) == (pytest.approx(truth, rel=1e-9),) * 2
        assert overall <= 1
        assert prom.scalar(substitute(panels["Used"], variables, "1m")) == chunk_bytes
        # One tenant: its RAM tier (capacity: the whole budget) is bounded by its slots.
        one = {**variables, "tenant": ["acme"]}
        assert prom.scalar(substitute(panels["Capacity used"], one, "1m")) == pytest.approx(
            ram["acme"]["used_bytes"] / ram["acme"]["capacity_bytes"], rel=1e-9)

        with urllib.request.urlopen(node.http + "/api/cluster", timeout=10) as resp:
            cluster = json.loads(resp.read())
        [cpu] = cluster["nodes"][0]["tiers"]
        assert cpu["used_bytes"] / cpu["capacity_bytes"] == pytest.approx(truth, rel=1e-9)
        totals = cluster["totals"]
        assert totals["used_bytes"] / totals["capacity_bytes"] == pytest.approx(truth, rel=1e-9)
    finally:
        if prom is not None:
            prom.proc.terminate()
            prom.proc.wait(20)
        node.kill()

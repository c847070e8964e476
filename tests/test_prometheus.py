"""The Grafana dashboard, evaluated by a real Prometheus (issue 12, item 4).

A real ``prometheus`` (Debian package; scripts/test.sh installs it) on a free loopback port
scrapes, every second, a 2-node kvtier-server cluster (auth on: three tenants, tenant labels
capped at two) and one engine-side registry: tests/_prom_loadgen.py, a kvtier client with
the library's and the vLLM connector's series, running prompts with shared prefixes. Then
every PromQL expression in deploy/grafana/kvtier-dashboard.json, its template variables
substituted as Grafana would (the variables' own label_values queries, answered by this
Prometheus), must return data through /api/v1/query, and the prompt-token hit ratio
Prometheus computes must equal the one the load generator counted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kvtier.chunk import encode_chunk
from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.node import NodeClient
from tests.kvtier_servers import ROOT, ServerProc, make_keys, start_server
from tests.prometheus_server import (
    SCRAPE_S,
    Prometheus,
    dashboard_queries,
    needs_prometheus,
    resolve_variables,
    start_prometheus,
    substitute,
)
from tests.waiting import wait_for

TOKEN = "prom-test-token-acme-0123456789"
TENANTS = ("acme", "beta", "gamma")  # capped at 2 on the servers: gamma reads "other"

pytestmark = needs_prometheus


@dataclass
class Scraped:
    prom: Prometheus
    nodes: list[ServerProc]
    client: str  # the load generator's instance label
    result: dict[str, Any]


def _provoke_refusals(node: ServerProc) -> None:
    """One request with an unknown token and one chunk stored under the wrong key: the auth
    failure and refused-chunk panels then show what a real operator sees, not 'no data'."""
    cfg = GrpcTierConfig(enabled=True, nodes=(node.address,), data_path="grpc", timeout_s=5.0)
    stranger = NodeClient(node.address, cfg, "not-a-token-of-this-cluster", None)
    with pytest.raises(NodeError, match="UNAUTHENTICATED"):
        stranger.lookup(make_keys(1), time.monotonic() + 5)
    stranger.close()
    acme = NodeClient(node.address, cfg, TOKEN, None)
    key, other = make_keys(2, seed=7)
    wrong = bytes(encode_chunk(b"\x01" * 32, other, "uint8", (1, 1, 4096, 1, 1), bytes(4096)))
    with pytest.raises(NodeError, match="INVALID_ARGUMENT|DATA_LOSS"):  # the server refuses the Put
        acme.grpc_put([Entry(key, wrong)], time.monotonic() + 5)
    acme.close()


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    work = tmp_path_factory.mktemp("prom")
    tokens = work / "tokens"
    tokens.write_text("".join(f"{TOKEN if t == 'acme' else f'prom-test-token-{t}-0123456789'} {t}\n"
                              for t in TENANTS))
    tokens.chmod(0o600)
    args = ("--tokens-file", str(tokens), "--cpu-bytes", "2MiB", "--slot-bytes", "16KiB",
            "--set", "metrics_label_values=2")
    gen_dir = work / "loadgen"
    gen_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "connectors"),
                                                        os.environ.get("PYTHONPATH", "")])}
    nodes: list[ServerProc] = []
    procs: list[subprocess.Popen[bytes]] = []  # the load generator, then Prometheus
    try:
        for i in range(2):
            nodes.append(start_server(work / f"n{i}", *args, name=f"n{i}"))
        with open(gen_dir / "loadgen.log", "ab") as out:
            gen = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_prom_loadgen.py"), str(gen_dir),
                                    ",".join(n.address for n in nodes), TOKEN, "acme"],
                                   stdout=out, stderr=subprocess.STDOUT, env=env, cwd=gen_dir)
        procs.append(gen)

        def gen_file(name: str) -> dict[str, Any] | None:
            if gen.poll() is not None:
                raise AssertionError(f"load generator exited {gen.returncode}:\n"
                                     + (gen_dir / "loadgen.log").read_text(errors="replace"))
            path = gen_dir / name
            return json.loads(path.read_text()) if path.exists() else None

        client = f"127.0.0.1:{wait_for('load generator /metrics', lambda: gen_file('ready.json'), 60)['port']}"
        prom = start_prometheus(work, {"kvtier-server": [n.http.removeprefix("http://") for n in nodes],
                                       "kvtier-clients": [client]})
        procs.append(prom.proc)

        def all_up() -> bool:
            targets = prom.api("targets")["activeTargets"]
            return len(targets) == 3 and all(t["health"] == "up" for t in targets)

        wait_for("every target scraped", all_up, 30)
        time.sleep(SCRAPE_S * 1.5)  # one more scrape: every declared series has a 0 sample
        (gen_dir / "go").touch()
        for node in nodes:
            _provoke_refusals(node)
        result = wait_for("load generator result", lambda: gen_file("result.json"), 120)
        # The last scrape must have happened after the load ended (counters final).
        lookups = f'sum(kvtier_lookup_requests_total{{instance="{client}"}})'
        wait_for("final counters scraped", lambda: prom.query(lookups) and prom.scalar(lookups) == result["requests"],
              30)
        time.sleep(SCRAPE_S * 2.5)  # and the servers' collectors once more
        yield Scraped(prom, nodes, client, result)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(20)
        for node in nodes:
            node.stop()


def _window(scraped: Scraped) -> str:
    """A range covering the whole load (so a rate over it sees every request)."""
    return f"{int(time.time() - scraped.result['started']) + 5}s"


def test_template_variables_resolve(scraped: Scraped) -> None:
    variables = resolve_variables(scraped.prom)
    assert variables["instance"] == sorted(n.http.removeprefix("http://") for n in scraped.nodes)
    assert variables["client"] == [scraped.client]
    # Three tenants, label values capped at 2: the third is summed into "other".
    assert variables["tenant"] == ["acme", "beta", "other"]


# Panels this load must move (a value > 0 in some series): the load saves, hits in both
# tiers, evicts on both sides, and the fixture provokes one refused chunk and auth failure.
MUST_MOVE = ("Used", "Capacity used", "Bytes in", "Bytes out", "Evictions", "Used bytes per node and tier",
             "Evictions per node and tier", "Chunk bytes per node and path", "Requests per method and status",
             "Refused chunks and auth failures", "Data-path connections", "Prompt-token hit rate", "Lookups",
             "Hit tokens per tier", "Miss tokens per reason", "Evictions per tier and reason",
             "Client tier capacity", "Tier bytes read / written", "Tokens restored per tier",
             "Restore latency p50 / p99", "Prompt-token hit rate per client", "Chunks saved, save jobs dropped")


def test_every_dashboard_expression_returns_data(scraped: Scraped) -> None:
    variables = resolve_variables(scraped.prom)
    empty = []
    moved: dict[str, float] = {}
    for title, expr in dashboard_queries():
        query = substitute(expr, variables, _window(scraped))
        result = scraped.prom.query(query)
        if not result:
            empty.append(f"{title}: {query}")
        values = [float(r["value"][1]) for r in result]
        moved[title] = max([moved.get(title, 0.0), *(v for v in values if v == v)])  # NaN != NaN
    assert not empty, "panels whose PromQL returns no data:\n" + "\n".join(empty)
    still = [title for title in MUST_MOVE if moved.get(title, 0.0) <= 0]
    assert not still, f"panels that show only 0 under load: {still}"


def test_prompt_token_hit_ratio_equals_the_load_generators(scraped: Scraped) -> None:
    res = scraped.result
    counted = res["hit_tokens"] / res["prompt_tokens"]
    assert 0.2 < counted < 0.9, f"load mix should have hits and misses, got {res}"
    # Restores may fall short of a lookup's hit (a node evicts in between): counted as failures.
    assert 0 < res["loaded_tokens"] <= res["hit_tokens"], res
    sel = f'instance="{scraped.client}"'
    cumulative = scraped.prom.scalar(
        f"sum(kvtier_lookup_hit_tokens_total{{{sel}}}) / (sum(kvtier_lookup_hit_tokens_total{{{sel}}})"
        f" + sum(kvtier_lookup_miss_tokens_total{{{sel}}}))")
    assert cumulative == pytest.approx(counted, abs=1e-9)
    # The dashboard's own stat, over a window covering the load.
    [stat] = [expr for title, expr in dashboard_queries() if title == "Prompt-token hit rate"]
    dashboard = scraped.prom.scalar(substitute(stat, resolve_variables(scraped.prom), _window(scraped)))
    assert dashboard == pytest.approx(counted, abs=1e-3)
    restored = scraped.prom.scalar(f"sum(kvtier_connector_load_tokens_total{{{sel}}})")
    assert restored == res["loaded_tokens"]
    # Per tier too; the load is shaped so both the local tier and the cluster serve hits.
    by_tier = {r["metric"]["tier"]: float(r["value"][1]) for r in scraped.prom.query(
        f"sum by (tier) (kvtier_lookup_hit_tokens_total{{{sel}}})")}
    assert by_tier == {tier: res["hit_tokens_by_tier"].get(tier, 0) for tier in ("cpu", "grpc")}
    assert min(by_tier.values()) > 0, by_tier


def test_deploy_prometheus_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    assert promtool, "the prometheus package ships promtool"
    out = subprocess.run([promtool, "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_capacity_panels_equal_what_the_nodes_hold(scraped: Scraped) -> None:
    """The capacity panels divide by what a node can hold. Three tenants share each node's
    2 MiB of RAM without quotas, so each tenant's own capacity is the whole 2 MiB: summed over
    tenants it read 6 MiB a node and the panels a third of the truth. That budget counts chunk
    bytes (8 KiB chunks in 16 KiB slots here: the slots held read twice as much)."""
    variables = resolve_variables(scraped.prom)
    panels = {title: expr for title, expr in dashboard_queries()}
    used: dict[str, int] = {}
    for node in scraped.nodes:
        with urllib.request.urlopen(node.http + "/api/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
        assert stats["capacity_bytes"] == {"cpu": 2 << 20}
        used[node.http.removeprefix("http://")] = sum(tier["chunk_bytes"] for t in stats["tenants"]
                                                      for tier in t["tiers"])
    assert all(used.values()), used
    overall = scraped.prom.scalar(substitute(panels["Capacity used"], variables, _window(scraped)))
    assert overall == pytest.approx(sum(used.values()) / (len(used) * (2 << 20)), rel=1e-6)
    per_node = {r["metric"]["instance"]: float(r["value"][1]) for r in scraped.prom.query(
        substitute(panels["Capacity per node and tier"], variables, _window(scraped)))}
    assert per_node == pytest.approx({inst: n / (2 << 20) for inst, n in used.items()}, rel=1e-6)

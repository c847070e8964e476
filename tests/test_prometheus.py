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
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvtier.chunk import encode_chunk
from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry
from kvtier.tiers.remote import GrpcTier
from kvtier.tiers.remote.errors import NodeError
from kvtier.tiers.remote.node import NodeClient
from tests.kvtier_servers import ROOT, ServerProc, make_chunk, make_keys, start_server
from tests.redis_servers import free_port

DASHBOARD = ROOT / "deploy" / "grafana" / "kvtier-dashboard.json"
TOKEN = "prom-test-token-acme-0123456789"
TENANTS = ("acme", "beta", "gamma")  # capped at 2 on the servers: gamma reads "other"
SCRAPE_S = 1

pytestmark = pytest.mark.skipif(shutil.which("prometheus") is None,
                                reason="prometheus not installed (scripts/test.sh installs it)")


def _wait(what: str, cond: Callable[[], Any], timeout: float) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as resp:
                doc = json.loads(resp.read())
        except urllib.error.HTTPError as exc:  # Prometheus says why (a PromQL parse error, ...)
            raise AssertionError(f"{path} {params}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None
        assert doc["status"] == "success", doc
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        result = data["result"]
        return result if data["resultType"] == "vector" else [{"value": result}]

    def scalar(self, expr: str) -> float:
        result = self.query(expr)
        assert len(result) == 1, f"{expr} -> {result}"
        return float(result[0]["value"][1])


def start_prometheus(workdir: Path, jobs: dict[str, list[str]]) -> Prometheus:
    """Prometheus on a free port scraping ``jobs`` (job -> host:port targets) every second."""
    config = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}
                                 for job, targets in jobs.items()]}
    (workdir / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = workdir / "prometheus.log"
    for _ in range(3):  # the free port may be taken before Prometheus binds it: try another
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                 f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
                 "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
        end = time.monotonic() + 30
        while time.monotonic() < end and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return prom
            except OSError:
                time.sleep(0.2)
        proc.kill()
        proc.wait(10)
    raise RuntimeError(f"prometheus did not start:\n{log.read_text(errors='replace')}")


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

        client = f"127.0.0.1:{_wait('load generator /metrics', lambda: gen_file('ready.json'), 60)['port']}"
        prom = start_prometheus(work, {"kvtier-server": [n.http.removeprefix("http://") for n in nodes],
                                       "kvtier-clients": [client]})
        procs.append(prom.proc)

        def all_up() -> bool:
            targets = prom.api("targets")["activeTargets"]
            return len(targets) == 3 and all(t["health"] == "up" for t in targets)

        _wait("every target scraped", all_up, 30)
        time.sleep(SCRAPE_S * 1.5)  # one more scrape: every declared series has a 0 sample
        (gen_dir / "go").touch()
        for node in nodes:
            _provoke_refusals(node)
        result = _wait("load generator result", lambda: gen_file("result.json"), 120)
        # The last scrape must have happened after the load ended (counters final).
        lookups = f'sum(kvtier_lookup_requests_total{{instance="{client}"}})'
        _wait("final counters scraped", lambda: prom.query(lookups) and prom.scalar(lookups) == result["requests"],
              30)
        time.sleep(SCRAPE_S * 2.5)  # and the servers' collectors once more
        yield Scraped(prom, nodes, client, result)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(20)
        for node in nodes:
            node.stop()


# --- the dashboard's expressions --------------------------------------------------------------

def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus target in the dashboard JSON."""
    doc = json.loads(DASHBOARD.read_text())
    out = [(p.get("title", "?"), t["expr"]) for p in _panels(doc["panels"]) for t in p.get("targets", [])
           if "expr" in t]
    assert out, f"{DASHBOARD} has no PromQL targets"
    return out


_LABEL_VALUES = re.compile(r"^label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)$")


def resolve_variables(prom: Prometheus) -> dict[str, list[str]]:
    """Each query variable of the dashboard -> the values its label_values() query returns."""
    doc = json.loads(DASHBOARD.read_text())
    out: dict[str, list[str]] = {}
    for var in doc["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = _LABEL_VALUES.match(query.strip())
        assert m, f"variable {var['name']}: {query!r} is not label_values(metric, label)"
        out[var["name"]] = sorted(prom.api(f"label/{m['label']}/values", **{"match[]": m["metric"]}))
    return out


def substitute(expr: str, variables: dict[str, list[str]], rate_interval: str) -> str:
    """Grafana's substitution with every value selected ("All" as the explicit alternation)."""
    expr = expr.replace("$__rate_interval", rate_interval)
    for name in sorted(variables, key=len, reverse=True):  # $client before a shorter prefix
        # Regex-escaped, then escaped again for the PromQL string literal (as Grafana does).
        alternation = "|".join(re.escape(v).replace("\\", "\\\\") for v in variables[name])
        expr = expr.replace("${" + name + "}", alternation).replace("$" + name, alternation)
    leftover = re.search(r"\$\{?\w+", expr)
    assert leftover is None, f"unsubstituted variable {leftover.group(0)} in {expr}"
    return expr


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
            _wait(f"both nodes scraped at {total} prompt tokens", lambda t=total: scraped(t), 30)
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
        _wait("the stored chunks scraped", lambda: prom.query(chunks_q) and prom.scalar(chunks_q) == chunk_bytes
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

"""The cluster dashboard: pure aggregation (a down peer, a node named twice, a budget the
tenants share), two real kvtier-server processes that show each other on /api/cluster and
/dashboard (and one of them dying), and the Grafana dashboard's PromQL against the metric
names kvtier actually declares. How peers are found and fetched: test_dashboard_peers.py."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvtier_vllm.metrics import ConnectorMetrics

from kvtier.config import CpuTierConfig, DiskTierConfig, GrpcTierConfig
from kvtier.metrics import Metrics
from kvtier.server import dashboard
from kvtier.server.app import declare_node_capacity
from kvtier.server.auth import Tenant
from kvtier.server.dashboard import PeerReply, cluster_document, node_summary
from kvtier.server.metrics import ServerMetrics
from kvtier.server.storage import Storage
from kvtier.tiers.base import Entry
from kvtier.tiers.remote import GrpcTier
from tests.kvtier_servers import ROOT, ServerProc, make_chunk, make_keys, start_server
from tests.redis_servers import free_port


def stats_doc(node: str, ram_used: int = 100, disk_used: int = 300, lookup_hits: dict[str, int] | None = None,
              get_misses: dict[str, int] | None = None) -> dict[str, Any]:
    """A /api/stats document shaped as kvtier-server writes it (one tenant, RAM over disk)."""
    return {
        "node_id": node, "version": "0.1", "uptime_s": 5.0, "ports": {}, "draining": False,
        "tenants": [{
            "tenant": "default", "used_bytes": disk_used, "quota_bytes": 1000, "entries": 3, "evictions": 2,
            "tiers": [{"name": "cpu", "used_bytes": ram_used, "capacity_bytes": 500, "entries": 1,
                       "evictions": {"capacity": 4}},
                      {"name": "disk", "used_bytes": disk_used, "capacity_bytes": 1000, "entries": 3,
                       "evictions": {"capacity": 2}}],
            "lookup": {"requests": 2, "hit_chunks": lookup_hits or {"cpu": 6, "disk": 2},
                       "miss_chunks": {"absent": 2}},
            "get": {"hit_chunks": {"cpu": 1, "disk": 1}, "miss_chunks": get_misses or {"evicted": 2}},
            "bytes_in": 4000, "bytes_out": 800, "puts_refused": 0,
        }],
    }


# --- pure aggregation ----------------------------------------------------------------------------

def test_node_summary_sums_tiers_and_computes_hit_rates() -> None:
    doc = stats_doc("a")
    second = json.loads(json.dumps(doc["tenants"][0]))
    second["tenant"] = "team-b"
    doc["tenants"].append(second)
    n = node_summary(doc, "10.0.0.1:50052", 0.0123)
    assert (n["node_id"], n["up"], n["latency_ms"]) == ("a", True, 12.3)
    cpu, disk = n["tiers"]
    assert (cpu["name"], cpu["used_bytes"], cpu["capacity_bytes"], cpu["entries"]) == ("cpu", 200, 1000, 2)
    # Hit rates count lookups only: the Gets that follow them read the same chunks again.
    assert (cpu["hit_chunks"], disk["hit_chunks"]) == (12, 4)
    assert cpu["evictions"] == {"capacity": 8} and disk["evictions"] == {"capacity": 4}
    # 4 lookup misses (absent 2, per tenant): disk saw 4 hits + 4 misses, cpu all 20.
    assert disk["hit_rate"] == pytest.approx(4 / 8) and cpu["hit_rate"] == pytest.approx(12 / 20)
    t = n["totals"]
    assert (t["used_bytes"], t["capacity_bytes"], t["entries"]) == (600, 2000, 6)  # the bottom tier
    assert (t["hit_chunks"], t["miss_chunks"], t["hit_rate"]) == (16, 4, pytest.approx(16 / 20))
    assert (t["read_hit_chunks"], t["read_miss_chunks"]) == (4, 4)
    assert t["miss_reasons"] == {"absent": 4} and t["read_miss_reasons"] == {"evicted": 4}
    assert t["evictions"] == {"capacity": 12}
    assert (t["bytes_in"], t["bytes_out"], t["lookups"]) == (8000, 1600, 4)
    assert [x["tenant"] for x in n["tenants"]] == ["default", "team-b"]
    assert n["tenants"][1]["hit_rate"] == pytest.approx(8 / 10)


def test_node_capacity_is_the_budget_the_tenants_share_and_lower_tier_hits_count_below() -> None:
    """Tenants without a quota may each fill the node's whole budget: the node holds it once,
    not once per tenant. Hits of a tier the node does not list (its lower tier, redis) are
    chunks that passed the listed tiers."""
    doc = stats_doc("a", lookup_hits={"cpu": 2, "disk": 2, "redis": 4})
    second = json.loads(json.dumps(doc["tenants"][0]))
    second["tenant"] = "team-b"
    doc["tenants"].append(second)
    doc["capacity_bytes"] = {"cpu": 600, "disk": 1500}
    n = node_summary(doc)
    cpu, disk = n["tiers"]
    assert (cpu["capacity_bytes"], disk["capacity_bytes"], n["totals"]["capacity_bytes"]) == (600, 1500, 1500)
    # per tenant: 2 misses, 4 redis hits, 2 disk, 2 cpu -> disk served 2 of 8, cpu 2 of 10
    assert disk["hit_rate"] == pytest.approx(2 / 8) and cpu["hit_rate"] == pytest.approx(2 / 10)
    assert n["totals"]["hit_rate"] == pytest.approx(8 / 10)
    doc["capacity_bytes"] = {"cpu": 5000, "disk": 5000}  # quotas below the budget: their sum
    assert [t["capacity_bytes"] for t in node_summary(doc)["tiers"]] == [1000, 2000]


def test_node_summary_of_a_server_without_traffic_fields_reads_zeros() -> None:
    doc = {"node_id": "old", "tenants": [{"tenant": "default", "used_bytes": 5, "quota_bytes": 10, "entries": 1,
                                          "evictions": 0, "tiers": [{"name": "cpu", "used_bytes": 5,
                                                                     "capacity_bytes": 10, "entries": 1}]}]}
    n = node_summary(doc)
    assert n["totals"]["hit_rate"] is None and n["totals"]["hit_chunks"] == 0
    assert n["tiers"][0]["evictions"] == {} and n["tiers"][0]["hit_rate"] is None


def test_cluster_document_marks_a_down_peer_and_skips_itself() -> None:
    local = stats_doc("a")
    replies = [PeerReply("h:1", stats_doc("a"), "", 0.001),  # this node, listed in the shared peer list
               PeerReply("h:2", stats_doc("b", ram_used=50), "", 0.002),
               PeerReply("h:3", None, "Connection refused", 0.0004)]
    doc = cluster_document(local, replies, now=123.0)
    assert [(n["node_id"], n["up"]) for n in doc["nodes"]] == [("a", True), ("b", True), ("h:3", False)]
    assert doc["nodes"][0]["address"] == "self" and doc["nodes"][2]["error"] == "Connection refused"
    assert (doc["nodes_up"], doc["nodes_down"], doc["generated_at"], doc["self"]) == (2, 1, 123.0, "a")
    t = doc["totals"]
    assert (t["used_bytes"], t["capacity_bytes"], t["hit_chunks"], t["miss_chunks"]) == (600, 2000, 16, 4)
    assert (t["read_hit_chunks"], t["read_miss_chunks"], t["hit_rate"]) == (4, 4, pytest.approx(16 / 20))
    assert t["evictions"] == {"capacity": 12}
    tiers = {x["name"]: x for x in doc["tiers"]}
    assert tiers["cpu"]["used_bytes"] == 150 and tiers["disk"]["evictions"] == 4
    json.dumps(doc)  # it is served as JSON


def test_cluster_document_with_every_peer_down_still_has_this_node() -> None:
    doc = cluster_document(stats_doc("a"), [PeerReply("x:1", None, "no reply within 1s", 1.0)])
    assert [n["up"] for n in doc["nodes"]] == [True, False] and doc["totals"]["used_bytes"] == 300


# --- two real servers -----------------------------------------------------------------------------

@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[tuple[ServerProc, ServerProc]]:
    ha, hb = free_port(), free_port()
    peers = f"127.0.0.1:{ha},127.0.0.1:{hb}"  # the same list on both: each skips itself
    a = start_server(tmp_path / "a", "--node-id", "node-a", "--peers", peers, "--disk-dir", "disk",
                     "--disk-bytes", "64MiB", ports=("--port", "0", "--http-port", str(ha), "--data-port", "0"),
                     name="a")
    try:
        # b: RAM only and 4 one-MiB slots, so that its share of the chunks forces evictions.
        b = start_server(tmp_path / "b", "--node-id", "node-b", "--peers", peers, "--cpu-bytes", "4MiB",
                         ports=("--port", "0", "--http-port", str(hb), "--data-port", "0"), name="b")
    except BaseException:
        a.kill()
        raise
    yield a, b
    for s in (a, b):
        s.kill()


def get(url: str) -> tuple[int, dict[str, str], bytes]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, dict(resp.headers), resp.read()


def test_two_servers_show_each_other_and_a_dead_one_shows_down(pair: tuple[ServerProc, ServerProc]) -> None:
    a, b = pair
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(a.address, b.address), timeout_s=5.0))
    try:
        keys = make_keys(40, seed=11)
        assert all(tier.put([Entry(k, make_chunk(k, 4096, i), depth=i) for i, k in enumerate(keys)]))
        tier.probe(keys)
        tier.get(keys + make_keys(20, seed=12))  # absent: each node misses some (none: odds 2**-20)
    finally:
        tier.close()

    stats = json.loads(get(a.http + "/api/stats")[2])  # additive fields the dashboard reads
    tenant = stats["tenants"][0]
    assert {"lookup", "get", "bytes_in", "bytes_out"} <= set(tenant)
    assert [set(t["evictions"]) for t in tenant["tiers"]] == [{"capacity"}, {"capacity"}]

    metrics = get(a.http + "/metrics")[2].decode()  # the Grafana panels' hit/miss series exist
    assert re.search(r'^kvtier_server_hit_chunks_total\{op="get",tenant="default",tier="cpu"\} [1-9]', metrics, re.M)
    assert re.search(r'^kvtier_server_miss_chunks_total\{op="get",reason="absent",tenant="default"\} [1-9]',
                     metrics, re.M)

    status, _, body = get(a.http + "/api/cluster")
    doc = json.loads(body)
    assert status == 200 and doc["self"] == "node-a" and (doc["nodes_up"], doc["nodes_down"]) == (2, 0)
    na, nb = doc["nodes"]
    assert (na["node_id"], nb["node_id"], nb["address"]) == ("node-a", "node-b", f"127.0.0.1:{b.ports['http']}")
    assert [t["name"] for t in na["tiers"]] == ["cpu", "disk"] and [t["name"] for t in nb["tiers"]] == ["cpu"]
    for node in (na, nb):
        assert all(t["used_bytes"] > 0 and t["entries"] > 0 and t["capacity_bytes"] > 0 for t in node["tiers"])
        assert node["totals"]["bytes_in"] > 0 and node["totals"]["read_hit_chunks"] > 0
        assert node["tenants"][0]["tenant"] == "default"
    assert nb["tiers"][0]["evictions"]["capacity"] > 0  # 4 slots, ~20 chunks placed on b
    assert doc["totals"]["read_miss_chunks"] >= 20 and doc["totals"]["read_miss_reasons"]["absent"] >= 20
    # The lookup's run may stop at once (b evicts; which keys is chance): its rate is defined.
    assert doc["totals"]["bytes_out"] > 0 and doc["totals"]["hit_rate"] is not None

    status, headers, page = get(b.http + "/dashboard")
    html = page.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "/api/cluster" in html and "<script" in html
    assert not re.search(r"https?://", html), "the page must not load anything from elsewhere"
    assert not re.search(r"""(src|href)\s*=\s*["']?//""", html), "no protocol-relative URLs either"

    b.kill()
    start = time.monotonic()
    doc = json.loads(get(a.http + "/api/cluster")[2])
    assert time.monotonic() - start < dashboard.PEER_TIMEOUT_S + 2.0
    assert [(n["node_id"], n["up"]) for n in doc["nodes"]] == [("node-a", True), (f"127.0.0.1:{b.ports['http']}", False)]
    assert doc["nodes"][1]["error"] and doc["nodes_down"] == 1
    assert doc["totals"]["used_bytes"] == na["totals"]["used_bytes"]  # only the live node counts
    assert get(a.http + "/dashboard")[0] == 200


# --- Grafana ------------------------------------------------------------------------------------

GRAFANA = ROOT / "deploy" / "grafana" / "kvtier-dashboard.json"
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
             "gauge": ("",), "summary": ("_sum", "_count", "_created"), "info": ("_info",)}


def declared_series(tmp_path: Path) -> set[str]:
    """Every series name kvtier's registries can expose, by prometheus_client's rules."""
    storage = Storage([Tenant("default")], CpuTierConfig(enabled=True, capacity_bytes=1 << 20,
                                                         slot_bytes=1 << 16),
                      DiskTierConfig(enabled=True, path=str(tmp_path), capacity_bytes=1 << 20))
    try:
        names: set[str] = set()
        client = Metrics()
        ConnectorMetrics(client)  # the vLLM connector's series share the client registry
        server = ServerMetrics(storage)
        declare_node_capacity(server.registry, {"cpu": 1 << 20})  # as KVTierServer.start does
        for registry in (client.registry, server.registry):
            for family in registry.collect():
                names.update(family.name + s for s in _SUFFIXES[family.type])
        return names
    finally:
        storage.close()


def exprs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query") and isinstance(value, str):
                yield value
            else:
                yield from exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from exprs(item)


def test_grafana_dashboard_uses_only_declared_metric_names(tmp_path: Path) -> None:
    board = json.loads(GRAFANA.read_text())
    queries = list(exprs(board))
    used = {m for q in queries for m in re.findall(r"kvtier_[a-z_]+", q)}
    declared = declared_series(tmp_path)
    assert len(queries) >= 10 and len(used) >= 10
    assert not used - declared, f"undeclared metric names in {GRAFANA.name}: {sorted(used - declared)}"
    # Panels cover the dashboard's promise: hit rate, bytes, evictions, capacity per node and tier.
    for name in ("kvtier_server_tier_used_bytes", "kvtier_server_tier_capacity_bytes",
                 "kvtier_server_evictions_total", "kvtier_server_chunk_bytes_total",
                 "kvtier_server_hit_chunks_total", "kvtier_lookup_hit_tokens_total", "kvtier_evictions_total"):
        assert name in used, name
    assert "kvtier_server_requests" not in declared  # the rule is not "any prefix goes"


def _samples(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(r"^" + name + r"\{([^}]*)\} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1).split(",") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_a_node_shows_its_budget_once_and_the_lookup_hit_rate(tmp_path: Path) -> None:
    """Ground truth on a real node: three tenants share a 4 MiB RAM budget (no quotas, so each
    may fill all of it) -- the node holds 4 MiB, not 12; a client looks up a 10-chunk prefix
    of which 5 chunks are stored and reads those 5, as an engine does -- the hit rate is 50 %
    on /api/cluster and by the Grafana panel's formula over /metrics (it read 67 %: the reads
    were added to the lookups' hits)."""
    tokens = tmp_path / "tokens"
    tokens.write_text("".join(f"dash-token-{t}-0123456789 {t}\n" for t in ("a", "b", "c")))
    tokens.chmod(0o600)
    node = start_server(tmp_path / "n", "--tokens-file", str(tokens), "--cpu-bytes", "4MiB",
                        "--slot-bytes", "64KiB", name="n")
    try:
        tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(node.address,), token="dash-token-a-0123456789",
                                       timeout_s=5.0))
        try:
            keys = make_keys(10, seed=21)
            assert all(tier.put([Entry(k, make_chunk(k, 4096, i), depth=i) for i, k in enumerate(keys[:5])]))
            assert tier.probe(keys).hits == 5
            assert all(isinstance(c, (bytes, bytearray, memoryview)) for c in tier.get(keys[:5]))
        finally:
            tier.close()
        doc = json.loads(get(node.http + "/api/cluster")[2])
        [n] = doc["nodes"]
        assert [(t["name"], t["capacity_bytes"]) for t in n["tiers"]] == [("cpu", 4 << 20)]
        assert doc["totals"]["capacity_bytes"] == 4 << 20
        assert (doc["totals"]["hit_chunks"], doc["totals"]["miss_chunks"]) == (5, 5)
        assert doc["totals"]["hit_rate"] == pytest.approx(0.5)
        assert (doc["totals"]["read_hit_chunks"], doc["totals"]["read_miss_chunks"]) == (5, 0)

        text = node.metrics()
        hits = _samples(text, "kvtier_server_hit_chunks_total", op="lookup")
        misses = _samples(text, "kvtier_server_miss_chunks_total", op="lookup")
        assert hits / (hits + misses) == pytest.approx(doc["totals"]["hit_rate"])
        assert _samples(text, "kvtier_server_node_capacity_bytes", tier="cpu") == 4 << 20
        assert _samples(text, "kvtier_server_tier_capacity_bytes", tier="cpu") == 3 * (4 << 20)  # per tenant
    finally:
        node.kill()


def test_a_node_reached_under_two_addresses_counts_once() -> None:
    """The same node under two names (its host name and its IP, or both address families of a
    headless Service) is one node: it added its bytes and hits to the cluster twice."""
    replies = [PeerReply("b.example:50052", stats_doc("b", ram_used=50), "", 0.001),
               PeerReply("10.0.0.2:50052", stats_doc("b", ram_used=50), "", 0.001)]
    doc = cluster_document(stats_doc("a"), replies, now=1.0)
    assert [n["node_id"] for n in doc["nodes"]] == ["a", "b"] and doc["nodes_up"] == 2
    assert (doc["totals"]["used_bytes"], doc["totals"]["hit_chunks"]) == (600, 16)

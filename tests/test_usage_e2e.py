"""Engine usage reports end to end: a real transformers connector (kvtier_hf, random Llama)
over two real kvtier-server processes. The figures on /api/cluster equal what the connector
returned; one replica on two nodes counts once; a server restart brings the replica's totals
back; a replica restart adds to them; a killed node costs reports, not the engine; a closed
replica shows as stopped reporting; the tenant comes from the token, never the payload."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier_hf import KVTierHF  # noqa: E402
from kvtier_hf.random_llama import TEST_SPEC, build_random_llama, random_prompt  # noqa: E402

from kvtier.config import KVTierConfig  # noqa: E402
from tests.kvtier_servers import ServerProc, start_server  # noqa: E402
from tests.redis_servers import free_port  # noqa: E402
from tests.waiting import wait_for  # noqa: E402

INTERVAL = 0.3
CHUNK = 16


def get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_random_llama(TEST_SPEC)


@pytest.fixture()
def pair(tmp_path: Path) -> Iterator[list[ServerProc]]:
    ha, hb = free_port(), free_port()
    peers = f"127.0.0.1:{ha},127.0.0.1:{hb}"
    nodes = []
    try:
        for name, port in (("node-a", ha), ("node-b", hb)):
            nodes.append(start_server(tmp_path / name, "--node-id", name, "--peers", peers, name=name,
                                      ports=("--port", "0", "--http-port", str(port), "--data-port", "0")))
        yield nodes
    finally:
        for s in nodes:
            s.kill()


def config(nodes: list[ServerProc], replica: str, token: str = "") -> KVTierConfig:
    return KVTierConfig.from_dict({
        "chunk_tokens": CHUNK, "cpu": {"enabled": False},
        "grpc": {"enabled": True, "nodes": [n.address for n in nodes], "timeout_s": 2.0, "token": token,
                 "backoff_s": 0.05, "backoff_max_s": 0.2},
        "usage": {"interval_s": INTERVAL, "replica_id": replica}})


def engines(node: ServerProc) -> dict[str, Any]:
    return get_json(node.http + "/api/cluster")["engines"]  # type: ignore[no-any-return]


def node_totals(node: ServerProc) -> dict[str, float]:
    reps = get_json(node.http + "/api/stats")["usage"]["replicas"]
    return {k: sum(r["totals"].get(k, 0) for r in reps) for k in ("prompt_tokens", "prefill_tokens_saved")}


def test_connector_reports_reach_the_cluster_once_and_survive_restarts(
        model: torch.nn.Module, pair: list[ServerProc]) -> None:
    a, b = pair
    shared, other = random_prompt(90, TEST_SPEC.vocab_size, 3), random_prompt(40, TEST_SPEC.vocab_size, 4)
    hf = KVTierHF(model, config(pair, "replica-1"))
    try:
        results = [hf.generate(shared, 2), hf.generate(shared, 2), hf.generate(other, 2)]
        hf.flush(5.0)
        prompt = sum(r.prompt_tokens for r in results)
        restored = sum(r.restored_tokens for r in results)
        assert results[1].restored_tokens == 89 and restored == 89  # the second run restores from the nodes

        # Both nodes' copies of the report: the totals can be complete (one node's copy
        # counts) before the second node's copy has arrived under a loaded machine.
        doc = wait_for("reports on /api/cluster from both nodes", lambda: (e := engines(a))["totals"]["prompt_tokens"]
                       == prompt and [r["nodes"] for r in e["replicas"]] == [["node-a", "node-b"]] and e)
        t = doc["totals"]
        assert (t["hit_tokens"], t["prefill_tokens_saved"], t["restored_tokens"]) == (restored, restored, restored)
        assert t["hits_per_tier"] == {"grpc": restored} and t["hit_ratio"] == pytest.approx(restored / prompt)
        assert sum(t["misses_per_reason"].values()) == prompt - restored
        assert t["ttft_ms_hit"] > 0 and t["ttft_ms_miss"] > 0 and t["restore_ms_p50"] is not None
        [rep] = doc["replicas"]  # one replica reporting to two nodes: counted once
        assert (rep["replica"], rep["model"], rep["tenant"], rep["nodes"]) == (
            "replica-1", TEST_SPEC.model_id, "default", ["node-a", "node-b"])
        assert engines(b)["totals"] == t  # either node serves the same cluster picture
        first_key = hf.prefix_cache.keys(shared[:CHUNK])[0].hex()[:16]
        assert doc["top_prefixes_by_hits"][0] == {"prefix": first_key, "hit_tokens": 89,
                                                  "restored_bytes": results[1].restore_bytes}
        assert sum(p for _, p, _, _ in doc["series"]) == prompt and doc["stopped"] == []

        # kvtier-server b restarts: the replica's next cumulative report brings its totals back.
        b.stop()
        b = pair[1] = b.restart()
        wait_for("totals back on the restarted node", lambda: node_totals(b)["prompt_tokens"] == prompt)

        # Node a dies: the engine goes on (a miss on a's chunks at most), reports to a drop.
        dropped = hf.usage.dropped if hf.usage else 0
        a.kill()
        again = hf.generate(shared, 2)
        prompt += again.prompt_tokens
        doc = wait_for("b alone", lambda: (e := engines(b))["totals"]["prompt_tokens"] == prompt and e)
        assert hf.usage is not None and hf.usage.dropped > dropped
        cluster = get_json(b.http + "/api/cluster")
        assert [(n["node_id"], n["up"]) for n in cluster["nodes"]] == [("node-b", True), (a.ports and f"127.0.0.1:{a.ports['http']}", False)]
    finally:
        hf.close()

    # The replica restarts (same id, counters from zero): its new traffic adds to the totals.
    hf2 = KVTierHF(model, config([b], "replica-1"))
    try:
        prompt += hf2.generate(other, 2).prompt_tokens
        wait_for("after the replica restart", lambda: node_totals(b)["prompt_tokens"] == prompt)
        [rep] = engines(b)["replicas"]
        assert rep["restarts"] == 1 and not rep["stale"]
    finally:
        hf2.close()
    # Closed: no more reports; after 3 intervals the replica is listed as stopped reporting.
    doc = wait_for("stopped reporting", lambda: (e := engines(b))["stopped"] and e, timeout=3 * INTERVAL + 5)
    assert [s["replica"] for s in doc["stopped"]] == ["replica-1"] and doc["reporting"] == 0
    assert doc["totals"]["prompt_tokens"] == prompt  # stopped replicas keep their figures


def test_the_tenant_comes_from_the_token(model: torch.nn.Module, tmp_path: Path) -> None:
    import grpc

    from kvtier.usage.reporter import METHOD

    tokens = tmp_path / "tokens"
    tokens.write_text("token-of-team-a-0123456789 team-a\ntoken-of-team-b-0123456789 team-b admin\n")
    tokens.chmod(0o600)
    node = start_server(tmp_path / "n", "--tokens-file", str(tokens), name="n")
    try:
        with KVTierHF(model, config([node], "r-a", token="token-of-team-a-0123456789")) as hf:
            hf.generate(random_prompt(40, TEST_SPEC.vocab_size, 5), 2)
        payload = json.dumps({"v": 1, "replica": "r-x", "source": "hf", "model": "m", "interval_s": 1,
                              "uptime_s": 1, "seq": 1, "tenant": "team-b", "counters": {"prompt_tokens": 7}}).encode()
        with grpc.insecure_channel(node.address) as channel:
            call = channel.unary_unary(METHOD)
            call(payload, timeout=5, metadata=(("authorization", "Bearer token-of-team-a-0123456789"),))
            for auth, code in ((("authorization", "Bearer not-a-valid-token-at-all"),), grpc.StatusCode.UNAUTHENTICATED), \
                              ((("authorization", "Bearer token-of-team-a-0123456789"),), grpc.StatusCode.INVALID_ARGUMENT):
                with pytest.raises(grpc.RpcError) as err:
                    call(payload if code != grpc.StatusCode.INVALID_ARGUMENT else b"{]", timeout=5, metadata=auth)
                assert err.value.code() == code
        reps = get_json(node.http + "/api/stats")["usage"]["replicas"]
        assert sorted((r["tenant"], r["replica"]) for r in reps) == [("team-a", "r-a"), ("team-a", "r-x")]
    finally:
        node.kill()

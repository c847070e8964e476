"""vLLM's log line of kvtier figures at TP=2 reads one engine's requests, not one per rank.

Drives vLLM's own stats path: two workers' ``KVTierStats`` (as ``WorkerSide`` collects them,
one ``StatsCollector`` per rank) in two ``ModelRunnerOutput``s, pickled as the multiproc
executor sends them, folded by vLLM's ``KVOutputAggregator``, the scheduler's own stats
aggregated in as ``Scheduler.update_from_output`` does, serialised with ``to_dict`` and fed,
two steps of it, to vLLM's ``KVConnectorLogging``, whose log line is what operators read.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvtier_vllm.stats import KVTierStats, StatsCollector  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402

from tests.vllm_halves import connector_halves  # noqa: E402

TP = 2
SHARD_BYTES = 1 << 20  # each rank's shard of one restored chunk run


def _worker_step(rank: int, failed: bool) -> ModelRunnerOutput:
    """One step of one rank: one request restored (256 tokens, its own shard of the bytes),
    4 chunks saved; ``failed``: 64 of those tokens fell short on this rank only."""
    stats = StatsCollector(rank=rank)
    stats.add(load_requests=1, load_tokens=256 - (64 if failed else 0), load_bytes=SHARD_BYTES,
              load_seconds=0.25 + 0.125 * rank)
    stats.add(save_chunks=4, save_bytes=4 * SHARD_BYTES, partial_hit_tokens=16)
    if failed:
        stats.add(load_failed_tokens=64)
        stats.add_by("failures_by_reason", "timeout")
    out = ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0},
                            kv_connector_output=KVConnectorOutput(kv_connector_stats=stats.take()))
    return pickle.loads(pickle.dumps(out))  # worker -> executor, as the multiproc executor sends it


def test_tp2_log_line_counts_requests_and_tokens_once_and_bytes_per_shard() -> None:
    aggregator = KVOutputAggregator(expected_finished_count=TP)
    logging = KVConnectorLogging(KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                                                  kv_connector_module_path="kvtier_vllm"))
    for step in range(2):
        out = aggregator.aggregate([_worker_step(rank, failed=step == 1 and rank == 1) for rank in range(TP)])
        assert out is not None and out.kv_connector_output is not None
        worker_stats = out.kv_connector_output.kv_connector_stats
        assert isinstance(worker_stats, KVTierStats)
        sched = StatsCollector()  # the scheduler half's (one per engine)
        sched.add(lookups=1, lookup_hit_tokens=256)
        sched.add_by("hit_tokens_by_tier", "cpu", 256)
        sched_stats = sched.take()
        assert sched_stats is not None
        logging.observe(worker_stats.aggregate(sched_stats).to_dict())
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    [line] = lines
    got = dict((k, float(v)) for k, v in re.findall(r"(\w+(?:\[\w+\])?)=([-\d.e]+)", line))
    assert got["lookups"] == 2 and got["lookup_hit_tokens"] == 512 and got["hit_tokens_by_tier[cpu]"] == 512
    assert got["load_requests"] == 2  # one request a step, not one per rank
    assert got["load_tokens"] == 512  # rank 0's whole run (rank 1 fell 64 short on step 1)
    assert got["load_failed_tokens"] == 64 and got["failures_by_reason[timeout]"] == 1
    assert got["save_chunks"] == 8 and got["partial_hit_tokens"] == 32
    assert got["load_seconds"] == pytest.approx(2 * 0.375)  # the slowest rank's
    assert got["load_bytes"] == 2 * TP * SHARD_BYTES  # bytes: every rank moves its own shard
    assert got["save_bytes"] == 2 * TP * 4 * SHARD_BYTES


def test_stats_without_ranks_still_sum() -> None:
    """A flat object (the scheduler's, or one serialised before ranks existed) sums as before."""
    a, b = KVTierStats(), KVTierStats()
    a.data["lookups"], b.data["lookups"] = 3, 4
    b.data["hit_tokens_by_tier"] = {"disk": 5}
    reduced = a.aggregate(b).reduce()
    assert reduced["lookups"] == 7 and reduced["hit_tokens_by_tier[disk]"] == 5
    assert KVTierStats().is_empty() and not a.is_empty()


def test_worker_half_reports_under_its_rank_and_declares_its_tiers(tmp_path: Path) -> None:
    """The real worker half (registered over CPU caches): its stats travel under its rank, and
    its restored-tokens series exist at 0 for every tier of its store before any restore."""
    sched, worker, _ = connector_halves(tmp_path, chunk=16, block=16, blocks=8, heads=1, head_dim=8, layers=2,
                                        cpu={"capacity_bytes": 1 << 20, "slot_bytes": 1 << 14})
    try:
        get = worker.metrics.registry.get_sample_value
        assert [t.name for t in worker.store.tiers] == ["cpu"]
        assert get("kvtier_connector_load_tokens_total", {"tier": "cpu"}) == 0
        worker.stats.add(load_requests=1, load_tokens=16, save_dropped=1)
        stats = worker.take_stats()
        assert stats is not None and stats.data["ranks"]["0"]["load_tokens"] == 16
        assert stats.data["load_tokens"] == 0  # the flat counters are the scheduler's ...
        assert stats.data["save_dropped"] == 1  # ... and each rank's own dropped jobs (usage.py reads it)
    finally:
        worker.shutdown()
        sched.shutdown()

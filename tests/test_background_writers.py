"""The background writers outlive a failure they did not expect: a tier whose put raises (a
bug: the contract says False per entry), a save or a capture that fails with an unexpected
exception costs that one batch, job or step (logged with its traceback and counted, or
raised where the caller waits); the thread goes on, so later work is done and flush/close
return. (The store's write-behind has its test in
tests/test_store.py.)"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.server.lower_io import WriteThrough
from kvtier.tiers.base import Entry
from tests.fakes import RaisingTier


def test_the_lower_tier_writer_outlives_a_put_that_raises(caplog: pytest.LogCaptureFixture) -> None:
    tier = RaisingTier("lower", times=1)
    writer = WriteThrough(tier, max_bytes=1 << 20, name="test-lower-writer")
    try:
        writer.offer([Entry(b"\x01" * 32, b"x" * 10)])
        assert writer.flush(5)
        writer.offer([Entry(b"\x02" * 32, b"y" * 10)])
        assert writer.flush(5)
        assert writer.counts["failed"] == 1 and writer.counts["written"] == 1
        assert tier.usage().entries == 1 and writer.queued_bytes == 0
    finally:
        writer.close(5)
    assert "a put raised" in caplog.text


def test_the_vllm_saver_outlives_a_job_that_fails_unexpectedly(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("torch")
    from kvtier_vllm.saver import SaveJob, Saver
    from kvtier_vllm.stats import ConnectorMetrics, StatsCollector

    from kvtier.metrics import Metrics

    def cache_for(salt: bytes) -> Any:
        raise KeyError(salt)  # not one of the save errors the saver expects

    stats = StatsCollector()
    saver = Saver(cache_for, chunk=16, depth=8, thread_init=lambda: None, stats=stats,
                  cmetrics=ConnectorMetrics(Metrics()))
    released = threading.Semaphore(0)
    fence = SimpleNamespace(wait=lambda: None)
    try:
        for i in range(2):
            spec = SimpleNamespace(req_id=f"req-{i}", tokens=b"", salt=b"s", start_chunk=0)
            job = SaveJob(spec, [], 0, release=released.release, index=None)  # type: ignore[arg-type]
            job.fence = fence  # type: ignore[assignment]
            assert saver.submit(job)
        for _ in range(2):  # the second job too: the thread survived the first
            assert released.acquire(timeout=5)
    finally:
        saver.close(5)
    taken = stats.take()
    assert taken is not None and taken.data["failures_by_reason"] == {"save_error": 2}
    assert "saving req-0 failed" in caplog.text and "KeyError" in caplog.text


def test_the_vllm_capture_thread_outlives_a_failed_capture() -> None:
    """A capture that fails with any exception is raised by the step's end_capture; the
    capture thread lives on, so the next step's captures run (and fail the same way here)
    instead of waiting forever in its queue."""
    torch = pytest.importorskip("torch")
    from kvtier_vllm.copier import CaptureIndex, CpuCopier

    copier = CpuCopier(thread_init=lambda: None)
    outcomes: list[str] = []

    def step() -> None:
        # views of the wrong type: a TypeError on the capture thread, not a shape error
        copier.capture_layer(None, 0, [(CaptureIndex([0], 1), [torch.empty(4)])])  # type: ignore[arg-type]
        try:
            copier.end_capture()
            outcomes.append("no error")
        except ValueError as exc:
            outcomes.append(str(exc))

    for _ in range(2):
        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(5)
        assert not thread.is_alive(), "end_capture waits forever: the capture thread died"
    assert len(outcomes) == 2 and all(o.startswith("capture failed") for o in outcomes), outcomes

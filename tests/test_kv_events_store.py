"""The store's residency listener (kvtier.store.StoreListener) and the connector's worker-side
event buffer: per tier puts, the cascade, promotions, evictions, deletes, refusals; the order
a router needs (a put's own evictions come after it); a failing listener never fails a put;
the bounded buffer drops and counts. Real tiers (memory, cpu), no engine."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvtier.config import CpuTierConfig, StoreConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import Entry
from kvtier.tiers.cpu import CpuTier
from kvtier.tiers.memory import MemoryTier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))


class Log:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, list[bytes]]] = []

    def chunks_stored(self, tier: str, entries: Sequence[Entry]) -> None:
        self.seen.append(("stored", tier, [e.key for e in entries]))

    def chunks_removed(self, tier: str, keys: Sequence[bytes]) -> None:
        self.seen.append(("removed", tier, list(keys)))

    def held(self) -> set[tuple[str, bytes]]:
        """A router's view after replaying every event in order."""
        out: set[tuple[str, bytes]] = set()
        for kind, tier, keys in self.seen:
            for k in keys:
                (out.add if kind == "stored" else out.discard)((tier, k))
        return out


def _key(i: int) -> bytes:
    return bytes([i]) * 32


def test_listener_sees_every_tier_and_its_view_matches_the_tiers() -> None:
    top = CpuTier(CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=256 << 10, pin_memory="never"), name="cpu")
    low = MemoryTier(name="disk")
    log = Log()
    with TieredStore([top, low], StoreConfig()) as store:
        store.listen(log)
        data = bytes(200 << 10)
        for i in range(6):  # 4 slots: the 5th and 6th puts evict from cpu
            store.store([Entry(_key(i), data, i)])
        store.flush()
        assert store.load([_key(0), _key(1)]).chunks  # from disk, promoted into cpu
        store.delete([_key(5)])
        store.flush()
        truth = {(t.name, _key(i)) for t in (top, low) for i in range(6) if t.contains([_key(i)])}
        assert log.held() == truth
        kinds = {(kind, tier) for kind, tier, _ in log.seen}
        assert {("stored", "cpu"), ("stored", "disk"), ("removed", "cpu"), ("removed", "disk")} <= kinds


def test_a_put_that_evicts_its_own_batch_is_reported_in_a_true_order() -> None:
    top = CpuTier(CpuTierConfig(capacity_bytes=1 << 20, slot_bytes=512 << 10, pin_memory="never"), name="cpu")
    log = Log()
    with TieredStore([top], StoreConfig()) as store:
        store.listen(log)
        store.store([Entry(_key(i), bytes(300 << 10), i) for i in range(3)])  # 2 slots for 3
        truth = {("cpu", _key(i)) for i in range(3) if top.contains([_key(i)])}
        assert len(truth) == 2 and log.held() == truth


def test_a_failing_listener_never_fails_a_put() -> None:
    class Broken:
        def chunks_stored(self, tier: str, entries: Sequence[Entry]) -> None:
            raise RuntimeError("listener bug")

        def chunks_removed(self, tier: str, keys: Sequence[bytes]) -> None:
            raise RuntimeError("listener bug")

    with TieredStore([MemoryTier(capacity_bytes=1000, name="m")]) as store:
        store.listen(Broken())
        assert store.store([Entry(_key(i), bytes(400), i) for i in range(4)]) == 4  # evictions too
        assert store.listener_errors >= 2


def test_worker_buffer_coalesces_runs_bounds_and_counts_drops() -> None:
    pytest.importorskip("vllm")
    from kvtier_vllm.events import WorkerEvents

    drops: list[int] = []
    buf = WorkerEvents(max_keys=5, on_drop=drops.append)
    for i in range(3):
        buf.chunks_removed("cpu", [_key(i)])  # evictions arrive one by one
    buf.bind("r1", 0, [_key(7)], b"")
    buf.chunks_stored("disk", [Entry(_key(8), b"x"), Entry(_key(9), b"y")])  # 6 > 5: dropped
    batch = buf.drain()
    assert batch is not None and drops == [2] and batch.dropped == 2
    assert [(e.stored, e.tier, e.keys) for e in batch.events] == [(False, "cpu", [_key(0), _key(1), _key(2)])]
    assert [(b.req_id, b.keys) for b in batch.bindings] == [("r1", [_key(7)])]
    assert buf.drain() is None


def test_connector_halves_describe_chunks_by_vllm_hashes_and_report_evictions(tmp_path: Path) -> None:
    """Scheduler and worker halves wired as in test_vllm_connector_flow, a cpu tier of two
    slots: the second request's chunks evict the first's, and the BlockRemoved names exactly
    the vLLM block hashes its BlockStored announced."""
    pytest.importorskip("vllm")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from tests.test_vllm_connector_flow import B, C, D, H, L, N, _fill, _output, _req, _run_step
    from tests.vllm_halves import connector_halves

    sched, worker, caches = connector_halves(tmp_path, chunk=C, block=N, blocks=B, heads=H, head_dim=D, layers=L,
                                             cpu={"capacity_bytes": "1MiB", "slot_bytes": "512KiB"},
                                             kv_events=True, name="ev")
    events: list[object] = []
    try:
        for rid, first, blocks in (("r1", 7, [10, 3, 40, 22, 5]), ("r2", 300, [11, 12, 13, 14, 15])):
            tokens = list(range(first, first + 4 * N + 3))  # 2 chunks + a tail
            r = _req(rid, tokens)
            r.block_hashes = [f"{rid}-block{i}".encode() for i in range(len(tokens) // N)]
            sched.get_num_new_matched_tokens(r, 0)
            sched.update_state_after_alloc(r, type("Blocks", (), {"get_block_ids": lambda self: ([],)})(), 0)
            _run_step(sched, worker, _output([(r, blocks, 0)], {rid: len(tokens)}), caches, write=_fill(blocks, first))
            end = time.monotonic() + 10  # the saver stores in the background; steps carry its events
            while sum(isinstance(e, BlockStored) for e in events) < (2 if rid == "r1" else 4):
                assert time.monotonic() < end, events
                time.sleep(0.02)
                _run_step(sched, worker, _output([], {}), caches)
                events += sched.take_events()
        time.sleep(0.1)
        _run_step(sched, worker, _output([], {}), caches)
        events += sched.take_events()
    finally:
        worker.shutdown()
        sched.shutdown()
    def h(rid: str, i: int) -> object:  # as vLLM publishes its own (ints by default in 0.32)
        return maybe_convert_block_hash(f"{rid}-block{i}".encode())  # type: ignore[arg-type]

    stored = [e for e in events if isinstance(e, BlockStored) and e.ownership == "kvtier:cpu"]
    assert [e.block_hashes for e in stored] == [[h("r1", 0), h("r1", 1)], [h("r1", 2), h("r1", 3)],
                                                [h("r2", 0), h("r2", 1)], [h("r2", 2), h("r2", 3)]]
    assert [e.parent_block_hash for e in stored] == [None, h("r1", 1), None, h("r2", 1)]
    assert stored[0].token_ids == list(range(7, 7 + C)) and {e.block_size for e in stored} == {N}
    assert {(e.medium, e.locality) for e in stored} == {("CPU", "LOCAL")}
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(h("r1", i) for i in range(4))

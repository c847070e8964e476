"""How close the demo's restore comes to the serving tier's own read speed, measured in pairs.

The disk under a VM is not one speed: back-to-back O_DIRECT passes over the same 50 MB read at
0.45 GB/s, then 1.4 GB/s, then 0.5 GB/s (the host's cache comes and goes). A restore measured
once against a read limit measured a moment later compares two different disks. So each pair
here is one restore and one plain read of the *same* chunks from the *same* tier, back to back,
the order alternating from pair to pair, and the figure is the median of the per-pair ratios.

- restore: :meth:`KVTierHF.restore_prefix`, the path ``generate`` takes (lookup, reads into the
  staging ring, verification, promotion, the copy into fresh K/V tensors), after deleting the
  chunks from the tiers above the serving one so that every chunk comes from that tier again;
- read: the tier's own ``get_into`` of those chunks into preallocated page-aligned buffers (for
  the disk tier: O_DIRECT into place), no verification, copy or promotion, one chunk per call
  from ``READ_DEPTH`` threads, and one ``get_into`` of them all; the faster of the two counts.
  Which pattern wins changes from run to run here (the demo's 25 chunks from the disk tier,
  one run: 1.13, 1.41 and 1.54 GB/s median at depth 1, 2 and 4, one sequential ``get_into``
  of all 25: 1.26; in another the restore at depth 2 read twice as fast as depth 4), so the
  limit is the best of both, measured each time.

Failure: a restore that does not take every chunk from the serving tier, or a plain read that
misses one, invalidates the measurement (RuntimeError naming what it got); store trouble is not
retried.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvtier.chunk import page_aligned_buffer
from kvtier.tiers.base import Miss

READ_DEPTH = 4  # reader threads of the plain read (see the module docstring)


@dataclass(frozen=True)
class RestorePairs:
    """GB/s of each pair's restore and read (same chunks, same tier, back to back)."""

    tier: str
    restore_gbps: tuple[float, ...]
    read_gbps: tuple[float, ...]

    @property
    def ratios(self) -> list[float]:
        return [r / t for r, t in zip(self.restore_gbps, self.read_gbps) if t > 0]

    @property
    def ratio(self) -> float:
        """Median of the per-pair ratios restore / read."""
        return statistics.median(self.ratios) if self.ratios else 0.0


def serving_tier(hits_per_tier: dict[str, int]) -> str:
    """The tier that served most of a restore's chunks."""
    return max(hits_per_tier, key=lambda name: hits_per_tier[name])


def measure_pairs(hf: Any, prompt: Sequence[int], hits_per_tier: dict[str, int], pairs: int = 5) -> RestorePairs:
    """``pairs`` (restore, read) pairs of ``prompt``'s cached prefix, which ``hf`` (a KVTierHF)
    restored from the tiers ``hits_per_tier`` names. Order alternates: restore first in even
    pairs, read first in odd ones."""
    from kvtier_hf.restore import buffer_bytes  # torch: imported when a phase runs

    cache = hf.prefix_cache
    tiers = list(cache.store.tiers)
    name = serving_tier(hits_per_tier)
    level = next(i for i, t in enumerate(tiers) if t.name == name)
    n = sum(hits_per_tier.values())
    # The chunks the restore reads: the first n of the prompt (the last possibly its partial one).
    keys = cache.keys(prompt)[:n]
    outs = [page_aligned_buffer(buffer_bytes(cache)) for _ in keys]

    def restore() -> float:
        for upper in tiers[:level]:
            upper.delete(keys)
        got = hf.restore_prefix(prompt)
        if dict(got.per_tier) != {name: n}:
            raise RuntimeError(f"a measured restore took {dict(got.per_tier)} chunks per tier, "
                               f"not all {n} from {name}: the pair measurement is void")
        return float(got.nbytes / got.seconds / 1e9)

    def nbytes(got: Sequence[int | Miss]) -> int:
        misses = [g for g in got if isinstance(g, Miss)]
        if misses:  # a read that skipped chunks would look slow and flatter the restore
            raise RuntimeError(f"the plain read of {name} missed {len(misses)} chunk(s) "
                               f"({misses[0].reason}): the pair measurement is void")
        return sum(g for g in got if isinstance(g, int))

    def read_one(i: int) -> int:
        return nbytes(tiers[level].get_into(keys[i:i + 1], outs[i:i + 1]))

    def timed(run: Callable[[], int]) -> float:
        t0 = time.perf_counter()
        nbytes = run()
        return nbytes / (time.perf_counter() - t0) / 1e9

    def read() -> float:
        parallel = timed(lambda: sum(pool.map(read_one, range(len(keys)))))
        whole = timed(lambda: nbytes(tiers[level].get_into(keys, outs)))
        return max(parallel, whole)

    pool = ThreadPoolExecutor(max_workers=READ_DEPTH, thread_name_prefix="kvtier-read-limit")

    restores, reads = [], []
    with pool:
        for i in range(pairs):
            if i % 2 == 0:
                restores.append(restore())
                reads.append(read())
            else:
                reads.append(read())
                restores.append(restore())
    return RestorePairs(name, tuple(restores), tuple(reads))

"""FaultyTier: the reference MemoryTier with failures injected by script or by probability.

For store and connector tests that need a tier to misbehave the way real media do: reads that
miss with a given reason (timeout, node_down, corrupt...), puts that fail, slow calls, and
reads that return corrupt bytes (a flipped payload byte, which ``decode_chunk`` must catch).

Scripted faults are exact and deterministic::

    tier = FaultyTier(capacity_bytes=1 << 20)
    tier.fail_gets(key, reason="timeout")          # every read of key misses with "timeout"
    tier.fail_gets(key, reason="node_down", times=1)  # only the next read
    tier.fail_puts(key)                            # puts of key return False
    tier.corrupt(key)                              # reads of key return corrupted bytes
    tier.down = True                               # everything misses "node_down" / put False

Probabilistic faults draw from a seeded ``random.Random`` (``seed``), so a run is repeatable:
``miss_rate`` + ``miss_reason``, ``put_fail_rate``, ``corrupt_rate``; ``delay_s`` sleeps in every
verb (a slow medium), ``read_bytes_per_s`` throttles ``get``/``get_into`` to that bandwidth
(a tier slower than the engine's prefill, for load-or-recompute tests). Faults apply to ``probe``/``contains`` (the run stops at a faulted key),
``get`` and ``get_into``. ``calls`` counts verb calls by name; ``injected`` counts faults.

RaisingTier breaks the tier contract on purpose (chosen verbs raise, as a bug would), for the
background writers and engine backends that must outlive such a tier.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence

from kvtier.chunk import HEADER_SIZE
from kvtier.tiers.base import NODE_DOWN, TIMEOUT, Entry, Miss, Probe, check_keys
from kvtier.tiers.memory import MemoryTier

_FOREVER = -1


class FaultyTier(MemoryTier):
    def __init__(self, capacity_bytes: int = 1 << 30, policy: str = "lru", name: str = "faulty", *,
                 seed: int = 0, miss_rate: float = 0.0, miss_reason: str = TIMEOUT,
                 put_fail_rate: float = 0.0, corrupt_rate: float = 0.0, delay_s: float = 0.0,
                 read_bytes_per_s: float = 0.0) -> None:
        super().__init__(capacity_bytes, policy, name)
        self.miss_rate = miss_rate
        self.miss_reason = miss_reason
        self.put_fail_rate = put_fail_rate
        self.corrupt_rate = corrupt_rate
        self.delay_s = delay_s
        self.read_bytes_per_s = read_bytes_per_s
        self.down = False
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._faults_lock = threading.Lock()
        self._get_faults: dict[bytes, tuple[str, int]] = {}
        self._put_faults: dict[bytes, int] = {}
        self._corrupt: dict[bytes, int] = {}

    # --- scripting ------------------------------------------------------------------------
    def fail_gets(self, key: bytes, reason: str = TIMEOUT, times: int = _FOREVER) -> None:
        """Reads of ``key`` miss with ``reason`` (the next ``times`` reads, or always)."""
        with self._faults_lock:
            self._get_faults[key] = (reason, times)

    def fail_puts(self, key: bytes, times: int = _FOREVER) -> None:
        with self._faults_lock:
            self._put_faults[key] = times

    def corrupt(self, key: bytes, times: int = _FOREVER) -> None:
        """Reads of ``key`` return its bytes with one payload byte flipped."""
        with self._faults_lock:
            self._corrupt[key] = times

    def heal(self) -> None:
        """Drop every scripted fault and probability, and come back up."""
        with self._faults_lock:
            self._get_faults.clear()
            self._put_faults.clear()
            self._corrupt.clear()
            self.miss_rate = self.put_fail_rate = self.corrupt_rate = 0.0
            self.delay_s = 0.0
            self.read_bytes_per_s = 0.0
            self.down = False

    # --- fault decisions ---------------------------------------------------------------------
    @staticmethod
    def _consume(table: dict[bytes, int], key: bytes) -> bool:
        left = table.get(key)
        if left is None:
            return False
        if left > 0:
            if left == 1:
                del table[key]
            else:
                table[key] = left - 1
        return True

    def _read_fault(self, key: bytes) -> Miss | None:
        with self._faults_lock:
            if self.down:
                return self._count(Miss(NODE_DOWN))
            scripted = self._get_faults.get(key)
            if scripted is not None:
                reason, left = scripted
                if left > 0:
                    if left == 1:
                        del self._get_faults[key]
                    else:
                        self._get_faults[key] = (reason, left - 1)
                return self._count(Miss(reason))
            if self.miss_rate and self._rng.random() < self.miss_rate:
                return self._count(Miss(self.miss_reason))
        return None

    def _count(self, miss: Miss) -> Miss:
        self.injected[f"miss:{miss.reason}"] += 1
        return miss

    def _should_corrupt(self, key: bytes) -> bool:
        with self._faults_lock:
            hit = self._consume(self._corrupt, key) or bool(
                self.corrupt_rate and self._rng.random() < self.corrupt_rate)
            if hit:
                self.injected["corrupt"] += 1
            return hit

    def _should_fail_put(self, key: bytes) -> bool:
        with self._faults_lock:
            hit = self.down or self._consume(self._put_faults, key) or bool(
                self.put_fail_rate and self._rng.random() < self.put_fail_rate)
            if hit:
                self.injected["put_fail"] += 1
            return hit

    def _enter(self, verb: str) -> None:
        self.calls[verb] += 1
        if self.delay_s:
            time.sleep(self.delay_s)

    # --- verbs --------------------------------------------------------------------------------
    def _probe(self, keys: Sequence[bytes]) -> Probe:
        self._enter("probe")
        inner = super()._probe(keys)
        for i in range(inner.hits):
            miss = self._read_fault(keys[i])
            if miss is not None:
                return Probe(i, miss.reason)
        return inner

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        check_keys(keys)
        self._enter("get")
        out: list[bytes | Miss] = []
        for key, value in zip(keys, super().get(keys)):
            miss = self._read_fault(key)
            if miss is not None:
                out.append(miss)
            elif isinstance(value, bytes) and self._should_corrupt(key):
                bad = bytearray(value)
                bad[HEADER_SIZE if len(bad) > HEADER_SIZE else len(bad) // 2] ^= 0x40  # payload byte
                out.append(bytes(bad))
            else:
                out.append(value)
        if self.read_bytes_per_s:
            time.sleep(sum(len(v) for v in out if isinstance(v, bytes)) / self.read_bytes_per_s)
        return out

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        self._enter("put")
        keep = [not self._should_fail_put(e.key) for e in entries]
        stored = iter(super().put([e for e, k in zip(entries, keep) if k]))
        return [next(stored) if k else False for k in keep]

    def delete(self, keys: Sequence[bytes]) -> int:
        self._enter("delete")
        return super().delete(keys)


class RaisingTier(MemoryTier):
    """A tier with a bug: the verbs in ``verbs`` raise ``KeyError("a bug in a tier")`` for the
    next ``times`` calls (-1: every call, until ``times`` is set to 0), where the contract says
    store trouble is a False or a Miss, never an exception. KeyError: no failure path expects it."""

    def __init__(self, name: str = "raising", times: int = -1, verbs: Sequence[str] = ("put",),
                 capacity_bytes: int = 1 << 30) -> None:
        super().__init__(capacity_bytes, name=name)
        self.times = times
        self.verbs = frozenset(verbs)

    def _bug(self, verb: str) -> None:
        if verb in self.verbs and self.times:
            self.times -= self.times > 0
            raise KeyError("a bug in a tier")

    def probe(self, keys: Sequence[bytes]) -> Probe:
        self._bug("probe")
        return super().probe(keys)

    def contains(self, keys: Sequence[bytes]) -> int:
        self._bug("contains")
        return super().contains(keys)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        self._bug("get_into")
        return super().get_into(keys, outs)

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        self._bug("put")
        return super().put(entries)

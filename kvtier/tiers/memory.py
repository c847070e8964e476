"""The reference tier: a bounded dict of immutable ``bytes``.

It defines what the contract means in the simplest code, and it is the base of the
fault-injecting fake used by store tests (``tests/fakes.py``). Not the fast path: ``cpu``
keeps chunks in a preallocated arena instead of one allocation per chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.policies import DEFAULT_POLICY, EvictionPolicy, NothingToEvict, make_policy
from kvtier.tiers.base import BoundedTier, Entry, Miss, Probe, check_keys


class MemoryTier(BoundedTier):
    def __init__(self, capacity_bytes: int = 1 << 30, policy: EvictionPolicy | str = DEFAULT_POLICY,
                 name: str = "memory") -> None:
        super().__init__()
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self._data: dict[bytes, bytes] = {}
        self._used = 0

    def _probe(self, keys: Sequence[bytes]) -> Probe:
        with self._lock:
            for i, key in enumerate(keys):
                if key not in self._data:
                    return Probe(i, self._absent(key).reason)
            return Probe(len(keys))

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        check_keys(keys)
        with self._lock:
            self._check_open()
            out: list[bytes | Miss] = []
            for key in keys:
                value = self._data.get(key)
                if value is None:
                    out.append(self._absent(key))
                else:
                    self.policy.access(key)
                    out.append(value)
            return out

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        check_keys([e.key for e in entries])
        evicted: list[tuple[bytes, bytes]] = []
        results: list[bool] = []
        with self._lock:
            self._check_open()
            for e in entries:
                results.append(self._put_one(e, evicted))
        listener = self.evict_listener
        if listener is not None:
            for key, value in evicted:
                listener(key, value)
        return results

    def _put_one(self, e: Entry, evicted: list[tuple[bytes, bytes]]) -> bool:
        size = memoryview(e.data).nbytes  # len() of a memoryview counts elements, not bytes
        if size > self.capacity_bytes:
            return False
        old = self._data.pop(e.key, None)
        if old is not None:
            self._used -= len(old)
            self.policy.remove(e.key)
        if self._pins and self._used + size > self.capacity_bytes and self._unfittable(size):
            self._keep(e, old)
            return False
        while self._used + size > self.capacity_bytes:
            try:
                victim = self._pick_victim()
            except NothingToEvict:
                self._keep(e, old)
                return False
            value = self._data.pop(victim)
            self._used -= len(value)
            self._remember_evicted(victim)
            evicted.append((victim, value))
        self._data[e.key] = bytes(e.data)
        self._used += size
        self._forget_evicted(e.key)
        self.policy.insert(e.key, size, e.depth, e.parent)
        return True

    def _keep(self, e: Entry, old: bytes | None) -> None:
        """A refused put: the key keeps the chunk it had (it fit before, so it fits again)."""
        if old is not None:
            self._data[e.key] = old
            self._used += len(old)
            self.policy.insert(e.key, len(old), e.depth, e.parent)

    def _size_of(self, key: bytes) -> int:
        value = self._data.get(key)
        return 0 if value is None else len(value)

    def delete(self, keys: Sequence[bytes]) -> int:
        check_keys(keys)
        with self._lock:
            self._check_open()
            n = 0
            for key in keys:
                value = self._data.pop(key, None)
                if value is not None:
                    self._used -= len(value)
                    self.policy.remove(key)
                    n += 1
            return n

    def _entries(self) -> int:
        return len(self._data)

    def check(self) -> list[str]:
        with self._lock:
            problems = []
            used = sum(len(v) for v in self._data.values())
            if used != self._used:
                problems.append(f"used_bytes {self._used} != sum of values {used}")
            if self._used > self.capacity_bytes:
                problems.append(f"used_bytes {self._used} > capacity {self.capacity_bytes}")
            if len(self.policy) != len(self._data):
                problems.append(f"policy tracks {len(self.policy)} keys, tier holds {len(self._data)}")
            return problems

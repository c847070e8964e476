"""Helpers the eviction-policy tests share: one-letter keys, draining a policy, inserting chains,
and a unit-size cache that replays chained requests (:class:`Cache`)."""

from __future__ import annotations

from collections.abc import Callable

from kvtier.policies import EvictionPolicy, NothingToEvict


def k(name: str) -> bytes:
    return name.encode()


def drain(p: EvictionPolicy) -> list[str]:
    """Evict until NothingToEvict; the victims, in order."""
    out = []
    while True:
        try:
            out.append(p.evict().decode())
        except NothingToEvict:
            return out


def insert_all(p: EvictionPolicy, names: str, chain: bool = False) -> None:
    """Insert one key per letter; ``chain`` makes each letter the child of the one before."""
    parent = b""
    for depth, name in enumerate(names):
        p.insert(k(name), 1, depth if chain else 0, parent if chain else b"")
        if chain:
            parent = k(name)


class Cache:
    """A unit-size cache of ``capacity`` keys driven like bench/replay.py: per request the
    leading run of present keys is read, the rest inserted as a chain, evicting when full.
    ``on_evict(victim)`` runs right after each eviction (the policy's state is as it left it);
    ``on_new(key, parent)`` when a key not tracked before is inserted."""

    def __init__(self, policy: EvictionPolicy, capacity: int,
                 on_evict: Callable[[bytes], None] | None = None,
                 on_new: Callable[[bytes, bytes], None] | None = None) -> None:
        self.policy, self.capacity = policy, capacity
        self.on_evict, self.on_new = on_evict, on_new
        self.victims: list[str] = []

    def request(self, names: list[str]) -> int:
        """Leading hits of the request."""
        p = self.policy
        hit = 0
        while hit < len(names) and k(names[hit]) in p:
            p.access(k(names[hit]))
            hit += 1
        parent = k(names[hit - 1]) if hit else b""
        for depth in range(hit, len(names)):
            key = k(names[depth])
            if key not in p:
                while len(p) >= self.capacity:
                    victim = p.evict()
                    self.victims.append(victim.decode())
                    if self.on_evict is not None:
                        self.on_evict(victim)
                if self.on_new is not None:
                    self.on_new(key, parent)
            p.insert(key, 1, depth, parent)
            parent = key
        return hit

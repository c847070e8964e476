"""Helpers the eviction-policy tests share: one-letter keys, draining a policy, inserting chains."""

from __future__ import annotations

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

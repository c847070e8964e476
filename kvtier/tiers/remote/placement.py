"""Where a chunk key lives: a pure function of the key and the node list (no I/O, no state).

Rendezvous (highest-random-weight) hashing: a key's replicas are the nodes with the highest
xxh3(key, seed=node seed). Every client with the same node list places a key identically, and
adding or removing a node moves only the keys that node gains or loses.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash


def node_seed(address: str) -> int:
    return xxhash.xxh3_64_intdigest(address.encode())


def rendezvous(key: bytes, seeds: Sequence[int], replicas: int) -> list[int]:
    """The ``replicas`` node indexes with the highest score xxh3(key, seed=node seed), best
    first. Pure and stable: every client with the same node list places a key identically."""
    scores = sorted(((xxhash.xxh3_64_intdigest(key, seed=s), i) for i, s in enumerate(seeds)), reverse=True)
    return [i for _, i in scores[:replicas]]

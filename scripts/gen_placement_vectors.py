"""Regenerate tests/vectors/placement_v1.json from kvtier.tiers.remote.placement (run only when
the placement version changes; a changed file means every client moves its keys).

    python scripts/gen_placement_vectors.py > tests/vectors/placement_v1.json
"""

from __future__ import annotations

import hashlib
import json
from typing import NamedTuple

import numpy as np

from kvtier.tiers.remote.placement import (
    PLACEMENT_VERSION,
    VNODES,
    Ring,
    mix64,
    node_seed,
    prefix_placement,
)


class Case(NamedTuple):
    nodes: list[str]
    replicas: int
    group: int
    chunks: int


CASES = [
    Case(["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"], replicas=1, group=1, chunks=8),
    Case(["[::1]:7001", "10.0.0.2:50051", "kvtier-0.kvtier.ns.svc:50051", "10.0.0.4:50051", "10.0.0.5:50051"],
         replicas=2, group=4, chunks=10),
    Case([f"10.1.{i // 4}.{i % 4}:50051" for i in range(16)], replicas=3, group=8, chunks=20),
    Case(["solo:1"], replicas=2, group=16, chunks=3),
]


def prefix_keys(case: int, n: int) -> list[bytes]:
    """Chained like real chunk keys: key_i = sha256(key_{i-1} || i)."""
    keys, prev = [], f"kvtier placement vectors case {case}".encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev)
    return keys


def main() -> None:
    out: dict[str, object] = {"version": PLACEMENT_VERSION, "vnodes": VNODES, "cases": []}
    cases: list[object] = []
    for n, case in enumerate(CASES):
        keys = prefix_keys(n, case.chunks)
        ring = Ring(case.nodes)
        seed = np.uint64(node_seed(case.nodes[0]))
        with np.errstate(over="ignore"):
            points = mix64(seed + np.arange(1, 4, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))
        cases.append({**case._asdict(), "keys_hex": [k.hex() for k in keys],
                      "first_node_points": [int(p) for p in points],
                      "placement": prefix_placement(ring, keys, case.group, case.replicas),
                      "placement_by_key": [ring.place(k, case.replicas) for k in keys]})
    out["cases"] = cases
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

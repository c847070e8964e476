"""Where a chunk key lives: a pure, versioned function of the key, its prefix and the node set.

Placement ``kvtier-placement/v1`` (docs/placement.md has the why and the figures):

- **Ring.** Each node name (``host:port`` as resolved, the same string in every client) gets
  ``VNODES`` = 2048 points on a 64-bit ring: ``point(name, v) = mix64(xxh3_64(name) + v * PHI)``
  for ``v = 1..VNODES`` (``mix64``: the splitmix64 finaliser, ``PHI = 0x9E3779B97F4A7C15``, all
  mod 2**64). Points are sorted by (value, name).
- **Key position.** ``pos(key)`` = the key's first 8 bytes as a little-endian uint64 (chunk keys
  are SHA-256 / xxh3-128 / blake3 outputs already: uniform, and nothing is gained by hashing
  again).
- **Replicas.** The first point with value >= ``pos`` (wrapping to the smallest), then
  clockwise: the first ``R`` distinct node names met, best first.
- **Groups.** Chunk ``d`` of a prefix (0-based depth) is placed by the key of chunk
  ``d - d % G`` of the same prefix (its group's first key), so G consecutive chunks share
  their nodes; ``G = 1`` places every key by itself.

Cost: O(log(N * VNODES)) per group (a ``searchsorted``), vectorised over a request; building
a ring for 1,000 nodes (2M points, ~30 MB) takes about a second and is done off the request path
when membership changes. Moving: a node that joins takes only its own arcs (about 1/N of the
keys); one that leaves gives only its own away.

Threads: a :class:`Ring` is immutable after construction; share it freely.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

PLACEMENT_VERSION = "kvtier-placement/v1"
VNODES = 2048
FIRST_WAVE = 4  # groups a probe asks at once first; each later wave doubles
_PHI = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
U64 = npt.NDArray[np.uint64]
I32 = npt.NDArray[np.int32]


def node_seed(name: str) -> int:
    """xxh3_64 of the node name (UTF-8): where its points start."""
    return xxhash.xxh3_64_intdigest(name.encode())


def mix64(z: U64) -> U64:
    """splitmix64's finaliser, element-wise (wraps mod 2**64)."""
    with np.errstate(over="ignore"):
        z = z ^ (z >> np.uint64(30))
        z = z * _M1
        z = z ^ (z >> np.uint64(27))
        z = z * _M2
        return z ^ (z >> np.uint64(31))


def key_positions(keys: Sequence[bytes]) -> U64:
    """``pos(key)`` for each key: its first 8 bytes, little-endian."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    if any(len(k) < 8 for k in keys):
        raise ValueError("placement needs keys of at least 8 bytes")
    return np.frombuffer(b"".join(k[:8] for k in keys), dtype="<u8").astype(np.uint64)


def anchor_depths(depths: Iterable[int], group: int) -> list[int]:
    """The depth of each chunk's group anchor: ``d - d % group``."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    return [d - d % group for d in depths]


class Ring:
    """The consistent-hash ring of one node set. ``names`` is sorted; replica lists are
    indexes into it (or names, from :meth:`place`)."""

    def __init__(self, names: Iterable[str], vnodes: int = VNODES) -> None:
        self.names: tuple[str, ...] = tuple(sorted(set(names)))
        if not self.names:
            raise ValueError("a ring needs at least one node")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        n = len(self.names)
        seeds = np.array([node_seed(s) for s in self.names], dtype=np.uint64)
        with np.errstate(over="ignore"):
            raw = seeds[:, None] + np.arange(1, vnodes + 1, dtype=np.uint64)[None, :] * _PHI
        points = mix64(raw).ravel()
        owners = np.repeat(np.arange(n, dtype=np.int32), vnodes)
        order = np.argsort(points)
        ordered = points[order]
        if (ordered[1:] == ordered[:-1]).any():  # equal points (~never): break ties by name
            order = np.lexsort((owners, points))
        self.points: U64 = points[order]
        self.owners: I32 = owners[order]
        self.next_other: I32 = _next_other(self.owners)
        self._name_array = np.array(self.names, dtype=object)

    def __len__(self) -> int:
        return len(self.names)

    def index_of(self, positions: U64) -> npt.NDArray[np.intp]:
        """The ring point each position lands on (first point >= it, wrapping)."""
        idx = np.searchsorted(self.points, positions, side="left")
        return np.where(idx == len(self.points), 0, idx)

    def replicas_at(self, positions: U64, replicas: int) -> I32:
        """Node indexes, shape (len(positions), min(replicas, N)), best first."""
        r = max(1, min(replicas, len(self.names)))
        cur: npt.NDArray[np.intp] = self.index_of(positions)
        out = np.empty((len(cur), r), dtype=np.int32)
        out[:, 0] = self.owners[cur]
        for col in range(1, r):
            cur = self.next_other[cur].astype(np.intp)
            cand = self.owners[cur]
            # Walk on while the candidate is a node already chosen for that row.
            taken = (out[:, :col] == cand[:, None]).any(axis=1)
            while taken.any():
                cur = np.where(taken, self.next_other[cur], cur).astype(np.intp)
                cand = self.owners[cur]
                taken = (out[:, :col] == cand[:, None]).any(axis=1)
            out[:, col] = cand
        return out

    def place(self, key: bytes, replicas: int) -> list[str]:
        """``key``'s replica names, best first (the key is its own anchor)."""
        row = self.replicas_at(key_positions([key]), replicas)[0]
        return [self.names[i] for i in row]

    def place_keys(self, anchor_keys: Sequence[bytes], replicas: int) -> list[list[str]]:
        """Replica names for each anchor key, best first. Keys of one group share one list
        (one ring lookup per distinct anchor): treat the lists as read-only."""
        if len(self.names) == 1:  # every position lands on the one node: no ring lookup
            if any(len(k) < 8 for k in anchor_keys):
                raise ValueError("placement needs keys of at least 8 bytes")
            return [list(self.names)] * len(anchor_keys)
        distinct = list(dict.fromkeys(anchor_keys))
        rows: list[list[str]] = self._name_array[self.replicas_at(key_positions(distinct), replicas)].tolist()
        if len(distinct) == len(anchor_keys):
            return rows
        by_anchor = dict(zip(distinct, rows))
        return list(map(by_anchor.__getitem__, anchor_keys))

    def place_run(self, keys: Sequence[bytes], depths: Sequence[int], anchors: dict[int, bytes],
                  group: int, replicas: int) -> list[list[str]]:
        """Replica names for chunks ``keys`` at ``depths`` of one prefix; ``anchors`` maps a
        group's first depth to its key (a key whose anchor is absent is its own anchor)."""
        heads = anchor_depths(depths, group)
        return self.place_keys([anchors.get(h, k) for h, k in zip(heads, keys)], replicas)


def _next_other(owners: I32) -> I32:
    """For each ring point, the index of the next point (clockwise) owned by another node;
    itself where there is no other node."""
    p = len(owners)
    change = owners != np.roll(owners, -1)  # i: point i+1 has another owner
    if not change.any():
        return np.arange(p, dtype=np.int32)
    at = np.where(change, np.arange(p), p)
    nxt = np.minimum.accumulate(at[::-1])[::-1]  # the first change at or after i
    nxt = np.where(nxt == p, int(np.argmax(change)), nxt)  # none after i: wrap to the first
    return ((nxt + 1) % p).astype(np.int32)


def _run_start(keys: Sequence[bytes], prefix: Sequence[bytes]) -> int:
    """d when ``keys`` is ``prefix[d:d + len(keys)]`` (the usual call), else -1."""
    try:
        d0 = prefix.index(keys[0])
    except ValueError:
        return -1
    return d0 if list(prefix[d0:d0 + len(keys)]) == list(keys) else -1


def place(ring: Ring, keys: Sequence[bytes], prefix: Sequence[bytes] | None, group: int,
          replicas: int) -> tuple[list[bytes], list[list[str]]]:
    """(anchor key, replica names) of each key: the one function both the tier and
    bench/cluster_sim.py place by. For a run of the prefix, one ring lookup per group."""
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    d0 = _run_start(keys, prefix) if prefix is not None and group > 1 and keys else -1
    if d0 < 0:
        anchors = anchor_keys(keys, prefix, group)
        return anchors, ring.place_keys(anchors, replicas)
    assert prefix is not None
    end = d0 + len(keys)
    heads = range(d0 - d0 % group, end, group)
    head_keys = [prefix[h] for h in heads]
    out_anchors: list[bytes] = []
    placement: list[list[str]] = []
    for h, key, names in zip(heads, head_keys, ring.place_keys(head_keys, replicas)):
        count = min(h + group, end) - max(h, d0)
        out_anchors += [key] * count
        placement += [names] * count
    return out_anchors, placement


def anchor_keys(keys: Sequence[bytes], prefix: Sequence[bytes] | None, group: int) -> list[bytes]:
    """The anchor of each key: ``prefix[d - d % group]`` for a key at depth ``d`` of ``prefix``
    (``prefix[d]`` is chunk d), the key itself when ``prefix`` is None or does not hold it."""
    if prefix is None or group == 1 or not keys:
        return list(keys)
    d0 = _run_start(keys, prefix)
    if d0 >= 0:
        return [prefix[d - d % group] for d in range(d0, d0 + len(keys))]
    depth: dict[bytes, int] = {}
    for d, k in enumerate(prefix):
        depth.setdefault(k, d)
    out = list(keys)
    for pos, k in enumerate(keys):
        at = depth.get(k)
        if at is not None:
            out[pos] = prefix[at - at % group]
    return out


def probe_waves(anchors: Sequence[bytes], first: int = FIRST_WAVE) -> list[tuple[int, int]]:
    """Position ranges [lo, hi) a probe asks in turn: runs of equal anchors are groups, and
    the waves take ``first`` groups, then twice as many each time. A probe stops after the
    first wave with a missing key, so a short hit never asks the nodes of later groups."""
    bounds = [0] + [p for p in range(1, len(anchors)) if anchors[p] != anchors[p - 1]] + [len(anchors)]
    out, group, wave = [], 0, first
    while group < len(bounds) - 1:
        out.append((bounds[group], bounds[min(group + wave, len(bounds) - 1)]))
        group, wave = group + wave, wave * 2
    return out


def prefix_placement(ring: Ring, prefix: Sequence[bytes], group: int, replicas: int) -> list[list[str]]:
    """Replica names of every chunk of a whole prefix (``prefix[0]`` is chunk 0): the
    reference form of the v1 mapping that the test vectors pin."""
    depths = range(len(prefix))
    anchors = {d: prefix[d] for d in set(anchor_depths(depths, group))}
    return ring.place_run(prefix, list(depths), anchors, group, replicas)

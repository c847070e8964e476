"""Latency of one lookup probe against a real kvtier-server, per path (bench/remote.py).

A probe (how many leading keys of a prompt a node holds) is the remote tier's per-call fixed
cost: a connector asks one before every restore, whether or not it finds anything. This module
stores ``chunks`` chunks of ``chunk_bytes`` on the node, then times single probes of all of them
(a full hit: the server walks every key) on each path, one call per sample:

* ``grpc``: :meth:`NodeClient.grpc_lookup`, the gRPC ``Lookup`` RPC (what every probe cost
  before the data path served LOOKUP).
* ``data_path``: :meth:`SocketDataPath.lookup`, one LOOKUP frame on a pooled data connection.
* ``client``: :meth:`GrpcTier.probe` with the default config, as a connector calls it
  (connectors/kvtier_vllm/local_probe.py): placement, ``NodeClient.use`` and
  ``NodeClient.lookup``, which picks the data path when a connection is free.
* ``client_grpc``: the same with ``data_path="grpc"`` (the config knob that keeps chunk bytes
  and probes on gRPC): what the connector-level probe costs without the data path.

Each path is forced by what the product already offers (the two node methods, the config
knob); nothing here reaches into private state. The paths are timed in interleaved blocks so
that load drift on a shared host hits each alike. Every call is checked to report all keys
present: a probe that answered a miss would be timing something else.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from _stats import Stats

from kvtier.chunk import encode_chunk
from kvtier.config import GrpcTierConfig
from kvtier.tiers.base import Entry, Probe
from kvtier.tiers.remote import GrpcTier

PATHS = ("grpc", "data_path", "client", "client_grpc")
BLOCK = 50  # calls per path before moving to the next one (interleaving granularity)


def _chunks(n: int, nbytes: int) -> list[Entry]:
    rng = random.Random(19)
    out = []
    for i in range(n):
        key = hashlib.sha256(f"lookup-latency/{i}".encode()).digest()
        payload = rng.randbytes(nbytes)
        out.append(Entry(key, bytes(encode_chunk(b"\0" * 32, key, "uint8", (1, 1, nbytes, 1, 1), payload)), i))
    return out


def _timed_block(fn: Callable[[], Probe], calls: int, want: int, out: list[float]) -> None:
    for _ in range(calls):
        start = time.perf_counter_ns()
        probe = fn()
        out.append((time.perf_counter_ns() - start) / 1e3)
        if probe.hits != want:
            raise RuntimeError(f"lookup found {probe.hits} of {want} keys ({probe.reason}): not a full hit")


def measure_lookups(address: str, calls: int, chunks: int = 16, chunk_bytes: int = 1 << 20,
                    warmup: int = 50) -> dict[str, list[float]]:
    """Per-call latencies in µs of ``calls`` probes of ``chunks`` stored keys, per path of
    :data:`PATHS`. Raises RuntimeError when the node offers no data path with LOOKUP (the
    figures would silently all be gRPC) or a probe does not find every key."""
    entries = _chunks(chunks, chunk_bytes)
    keys: Sequence[bytes] = [e.key for e in entries]
    tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(address,), timeout_s=30))
    grpc_tier = GrpcTier(GrpcTierConfig(enabled=True, nodes=(address,), timeout_s=30, data_path="grpc"))
    try:
        if not all(tier.put(entries)):
            raise RuntimeError(f"{address} did not store the {chunks} probe chunks")
        node = tier.nodes[0]
        data = node.data
        if data is None:
            raise RuntimeError(f"{address}: no data path (the data-path LOOKUP cannot be timed)")
        if grpc_tier.nodes[0].data is not None:
            raise RuntimeError("data_path='grpc' opened a data path: client_grpc would not be gRPC")

        def deadline() -> float:
            return time.monotonic() + 30

        def over_data_path() -> Probe:
            probe = data.lookup(keys, deadline())
            if probe is None:  # no free connection or no LOOKUP op: it would fall back to gRPC
                raise RuntimeError(f"{address}: the data path did not answer LOOKUP")
            return probe

        fns: dict[str, Callable[[], Probe]] = {
            "grpc": lambda: node.grpc_lookup(keys, deadline()),
            "data_path": over_data_path,
            "client": lambda: tier.probe(keys),
            "client_grpc": lambda: grpc_tier.probe(keys),
        }
        lat: dict[str, list[float]] = {p: [] for p in PATHS}
        for p in PATHS:  # warm: connections open, code paths hot
            _timed_block(fns[p], warmup, chunks, [])
        done = 0
        while done < calls:
            n = min(BLOCK, calls - done)
            for p in PATHS:
                _timed_block(fns[p], n, chunks, lat[p])
            done += n
        if node.data is not data:
            raise RuntimeError(f"{address}: the data path failed during the run (client figures mix paths)")
        return lat
    finally:
        tier.close()
        grpc_tier.close()


def summary(lat: dict[str, list[float]]) -> dict[str, Any]:
    """The JSON keys bench/remote.py adds: ``lookup_us_<path>`` as {"min","median","max"}
    and ``lookup_data_path_vs_grpc`` (median over median, below 1 is faster)."""
    out: dict[str, Any] = {}
    for p, values in lat.items():
        out[f"lookup_us_{p}"] = vars(Stats.of(values))
    out["lookup_data_path_vs_grpc"] = out["lookup_us_data_path"]["median"] / out["lookup_us_grpc"]["median"]
    out["lookup_client_vs_client_grpc"] = out["lookup_us_client"]["median"] / out["lookup_us_client_grpc"]["median"]
    return out

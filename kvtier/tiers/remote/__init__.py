"""The remote tier: a client of one or more kvtier-server nodes (config section ``grpc:``).

gRPC is the control plane and the portable fallback for bytes; chunk bytes take the fastest
path the pair supports (shared memory on the same host, length-prefixed frames over a plain
or TLS socket across hosts), so the package is named for the remote node, not for gRPC.

- ``tier``: :class:`GrpcTier`, the contract's verbs: fan-out over nodes, replication,
  deadlines, down nodes as misses.
- ``placement``: which nodes hold a key (a pure, versioned function of the key, its prefix
  and the node set: a consistent-hash ring, groups of G chunks placed together).
- ``membership``: the node set: a static list or DNS names re-resolved periodically.
- ``node``: one node: channel, RPCs, liveness, and the choice between data path and gRPC.
- ``data_path`` / ``data_conn``: the socket/shm data path (a connection pool, one connection).
- ``errors``: :class:`NodeError` and the reply guards both halves share (a leaf module).
"""

from kvtier.tiers.remote.placement import PLACEMENT_VERSION, Ring, prefix_placement
from kvtier.tiers.remote.tier import GrpcTier

__all__ = ["PLACEMENT_VERSION", "GrpcTier", "Ring", "prefix_placement"]

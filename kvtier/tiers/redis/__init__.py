"""The redis tier: Redis or Redis Cluster as a remote, shared tier (docs/redis.md).

- ``tier``: :class:`RedisTier`, the verbs (key naming, TTL bookkeeping, what a reply means).
- ``link``: the client, start-up checks and one pipelined round trip per batch, with failures
  returned as values.
- ``conn``: URLs, TLS/ACL settings and client construction (single node or cluster).
- ``health``: failure labels and per-node health (down, backoff, re-probe).
"""

from kvtier.tiers.redis.tier import RedisTier

__all__ = ["RedisTier"]

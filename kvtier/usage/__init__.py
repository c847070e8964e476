"""Engine usage reporting: what each engine replica got from the cache, sent to the cluster.

- :mod:`kvtier.usage.counters`: the cumulative counters a connector feeds (thread-safe);
- :mod:`kvtier.usage.wire`: the report payload (encode, and the strict decoder the server runs
  on bytes from outside);
- :mod:`kvtier.usage.reporter`: the background thread that sends the counters to every
  kvtier-server node of the store, off the request path.

The server side (deltas, restarts, stale replicas, caps) is :mod:`kvtier.server.usage`.
"""

from kvtier.usage.counters import UsageCounters

__all__ = ["UsageCounters"]

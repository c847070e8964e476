"""The wire between a kvtier client (the remote tier) and kvtier-server, imported by both.

- ``gen``: the gRPC control plane, generated from proto/kvtier/v1/kvtier.proto by
  scripts/gen_proto.py (never hand-edited).
- ``frames``: the bulk data path's length-prefixed frames, sans-I/O (encoders, an incremental
  reader with limits, parsers); fuzzed by the tests.
- ``session``: which frame may come when, on each side of a connection, sans-I/O.
- ``socket_io``: the two blocking socket loops both ends share (send all, read one frame).
- ``addresses``: parsing host:port, and which addresses are this machine (shared memory and
  clear text rules).

Nothing here imports the server or a tier.
"""

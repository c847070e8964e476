"""kvtier-server: the cache node daemon (gRPC service, HTTP side port, bulk data path).

Entry point: ``kvtier-server`` (:func:`kvtier.server.main.main`). Never imports torch.
"""

"""Eviction policies beyond the LRU baseline; import them through :mod:`kvtier.policy`."""

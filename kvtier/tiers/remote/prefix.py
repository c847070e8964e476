"""The grpc tier's verbs bound to one prefix (:meth:`GrpcTier.for_prefix`, the store's route):
consecutive chunks of a prefix are placed by their group's first key (docs/placement.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvtier.tiers.base import Entry, Miss, Probe, check_keys


class PlacedTier(Protocol):
    """What the bound verbs need of the grpc tier (kvtier.tiers.remote.tier.GrpcTier; not
    imported here, so the two modules do not import each other)."""

    name: str

    def _check_open(self) -> None: ...
    def _probe_in(self, keys: Sequence[bytes], prefix: Prefix | None) -> Probe: ...
    def _get_in(self, keys: Sequence[bytes], prefix: Prefix | None) -> list[bytes | Miss]: ...
    def _get_into_in(self, keys: Sequence[bytes], outs: Sequence[memoryview], prefix: Prefix | None
                     ) -> list[int | Miss]: ...
    def _put_in(self, entries: Sequence[Entry], prefix: Prefix | None) -> list[bool]: ...
    def _delete_in(self, keys: Sequence[bytes], prefix: Prefix | None) -> int: ...


class Prefix:
    """Chunk keys of one prefix: ``keys[d]`` is chunk ``d``."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = keys


class PrefixVerbs:
    """The tier's verbs bound to one prefix: keys are placed by their group's first key."""

    def __init__(self, tier: PlacedTier, prefix: Prefix) -> None:
        self.tier = tier
        self.prefix = prefix
        self.name = tier.name

    def probe(self, keys: Sequence[bytes]) -> Probe:
        check_keys(keys)
        self.tier._check_open()
        return self.tier._probe_in(keys, self.prefix)

    def contains(self, keys: Sequence[bytes]) -> int:
        return self.probe(keys).hits

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        return self.tier._get_in(keys, self.prefix)

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        return self.tier._get_into_in(keys, outs, self.prefix)

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        return self.tier._put_in(entries, self.prefix)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.tier._delete_in(keys, self.prefix)

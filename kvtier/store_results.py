"""What :class:`kvtier.store.TieredStore` returns (lookup and load results) and the listener
contract it reports chunk residency through. Frozen values: safe to keep and share between
threads; the buffers a load result holds are the caller's (``load_into``) or its own bytes."""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.codec import Buf
from kvtier.tiers.base import ABSENT, Entry


@dataclass(frozen=True)
class LookupResult:
    """``hits`` leading keys are present; ``runs`` says which tier holds them, in order, as
    (tier name, count) pairs; ``reason`` is why the run stopped."""

    hits: int
    runs: tuple[tuple[str, int], ...] = ()
    reason: str = ABSENT

    @property
    def per_tier(self) -> dict[str, int]:
        out: Tally[str] = Tally()
        for name, n in self.runs:
            out[name] += n
        return dict(out)


@dataclass(frozen=True)
class LoadResult:
    """The leading run of chunk bytes; ``sources[i]`` names the tier that served chunk i."""

    chunks: list[bytes]
    sources: list[str] = field(default_factory=list)
    reason: str = ABSENT

    @property
    def per_tier(self) -> dict[str, int]:
        return dict(Tally(self.sources))


@dataclass(frozen=True)
class LoadIntoResult:
    """The leading run :meth:`TieredStore.load_into` wrote: ``chunks[i]`` is a view of the
    caller's ``outs[i]`` trimmed to chunk i's length (or, for a stored chunk too large for its
    buffer, a ``bytes`` copy for the caller's verification to refuse); ``sources[i]`` names the
    tier that served it."""

    chunks: list[Buf]
    sources: list[str] = field(default_factory=list)
    reason: str = ABSENT

    @property
    def per_tier(self) -> dict[str, int]:
        return dict(Tally(self.sources))


class StoreListener(Protocol):
    """Chunk residency per tier, for whoever publishes it (KV events for prefix-aware routers).

    ``chunks_stored(tier, entries)``: ``tier`` is about to take ``entries`` (a save, the
    cascade, a promotion). ``chunks_removed(tier, keys)``: ``tier`` refused those ``keys``,
    evicted them (capacity) or a delete removed them (a delete may name keys the tier did not
    hold). Announcing a put before it runs keeps the order true when the put evicts a chunk
    of its own batch; the price: re-putting a chunk the same put evicts (a full tier whose
    victim is that very key) ends on "removed" although the chunk is held. Calls come from the
    thread that caused them (the caller's, the writer thread, a loader's), an eviction's with
    the tier's lock held: a listener must be quick (a bounded queue append), thread-safe, must
    not keep ``entry.data`` (the caller's buffer) and must never call into the store or a tier.
    """

    def chunks_stored(self, tier: str, entries: Sequence[Entry]) -> None: ...

    def chunks_removed(self, tier: str, keys: Sequence[bytes]) -> None: ...

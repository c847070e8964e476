"""What :class:`kvtier.store.TieredStore` returns (lookup and load results), the listener
contract it reports chunk residency through, and its fan-out to listeners. Frozen values: safe to keep and share between
threads; the buffers a load result holds are the caller's (``load_into``) or its own bytes."""

from __future__ import annotations

import logging
import threading
from collections import Counter as Tally
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier.codec import Buf
from kvtier.tiers.base import ABSENT, Entry

log = logging.getLogger("kvtier.store")


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
class Promotion:
    """Chunks a ``load_into(..., defer_promotion=True)`` took from below the top tier, still to
    be copied into the tiers above: :meth:`TieredStore.promote` does it, for the leading ones
    the caller verified. ``chunks`` are views of the caller's buffers: promote (or drop this)
    before reusing them. ``levels[i]``: the tier level that served ``chunks[i]``."""

    keys: tuple[bytes, ...] = ()
    chunks: tuple[Buf, ...] = ()
    levels: tuple[int, ...] = ()
    prefix: Sequence[bytes] | None = None


@dataclass(frozen=True)
class LoadIntoResult:
    """The leading run :meth:`TieredStore.load_into` wrote: ``chunks[i]`` is a view of the
    caller's ``outs[i]`` trimmed to chunk i's length (or, for a stored chunk too large for its
    buffer, a ``bytes`` copy for the caller's verification to refuse); ``sources[i]`` names the
    tier that served it; ``promotion``: what is left to promote (empty unless deferred)."""

    chunks: list[Buf]
    sources: list[str] = field(default_factory=list)
    reason: str = ABSENT
    promotion: Promotion = Promotion()

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


class Listeners:
    """The store's listeners and the fan-out to them. A put is announced (``stored``) before
    it runs and its refusals (``refused``) after it: an eviction the put itself causes (possibly
    of a chunk of the same batch) then reaches listeners after the announcement of what it
    evicts, so the last word on every key is the true one. A listener is foreign code running
    inside a tier's put or eviction: whatever it does wrong must not fail that put (a store
    never raises for this), so its exception is logged and counted (``errors``)."""

    def __init__(self) -> None:
        self._all: tuple[StoreListener, ...] = ()
        self._lock = threading.Lock()
        self.errors = 0

    def add(self, listener: StoreListener) -> None:
        with self._lock:
            self._all = (*self._all, listener)

    def stored(self, tier: str, entries: Sequence[Entry]) -> None:
        for listener in self._all:
            self._guard(listener.chunks_stored, tier, entries)

    def refused(self, tier: str, entries: Sequence[Entry], ok: Sequence[bool]) -> None:
        if self._all and not all(ok):
            self.removed(tier, [e.key for e, k in zip(entries, ok) if not k])

    def removed(self, tier: str, keys: Sequence[bytes]) -> None:
        for listener in self._all:
            self._guard(listener.chunks_removed, tier, keys)

    def _guard(self, call: Callable[[str, Any], None], tier: str, arg: Any) -> None:
        try:
            call(tier, arg)
        except Exception:  # noqa: BLE001 - logged and counted, never swallowed silently
            with self._lock:
                self.errors += 1
            log.exception("kvtier: a store listener failed on tier %s", tier)

"""The one contract every tier implements (memory, cpu, disk, redis, grpc, gpu).

Batch-first verbs over 32-byte chunk keys; values are *encoded chunks* (``kvtier.chunk``
bytes: header + payload), so every tier stores self-describing data.

Ownership
    ``put`` copies what it keeps: the caller may reuse ``Entry.data`` as soon as it returns.
    ``get`` returns ``bytes`` the caller owns; ``get_into`` writes into caller-owned buffers
    (the zero-allocation path) and returns how many bytes it wrote.
Threads
    Every method may be called from any thread; a tier serialises what needs serialising.
    ``close`` must be the last call; calls after it raise ``RuntimeError``.
Failure
    A failing medium (dead node, timeout, torn file, full disk) never raises out of a verb:
    a read returns :class:`Miss` with a reason, a write returns ``False`` and counts a drop.
    Verbs raise only for caller bugs (``ValueError``: wrong key length, buffer too small).
    Construction raises :class:`kvtier.errors.TierUnavailableError` when the tier cannot work
    at all (unwritable directory, bad credentials) so that a misconfiguration shows at start.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvtier.codec import Buf
from kvtier.keys import KEY_BYTES
from kvtier.policies import EvictionPolicy

# Miss reasons: each is a metric label value (kvtier_lookup_miss_tokens_total{reason=...}).
ABSENT = "absent"
EVICTED = "evicted"
EXPIRED = "expired"
CORRUPT = "corrupt"
TIMEOUT = "timeout"
NODE_DOWN = "node_down"
NAMESPACE_MISMATCH = "namespace_mismatch"
LAYOUT_MISMATCH = "layout_mismatch"
TOO_LARGE = "too_large"
ERROR = "error"
MISS_REASONS = (ABSENT, EVICTED, EXPIRED, CORRUPT, TIMEOUT, NODE_DOWN, NAMESPACE_MISMATCH,
                LAYOUT_MISMATCH, TOO_LARGE, ERROR)


@dataclass(frozen=True, slots=True)
class Miss:
    """A key a tier could not serve, and why."""

    reason: str


@dataclass(frozen=True, slots=True)
class Probe:
    """Result of a prefix probe: ``hits`` leading keys present; ``reason`` why the run stopped
    (``absent`` when it stopped at a key that is simply not there, or ran to the end)."""

    hits: int
    reason: str = ABSENT


@dataclass(frozen=True, slots=True)
class Entry:
    """One chunk to store. ``depth`` is the chunk's index in its prefix and ``parent`` the
    key of chunk ``depth - 1`` (``b""`` for the first chunk); policies may weigh both."""

    key: bytes
    data: Buf
    depth: int = 0
    parent: bytes = b""


@dataclass(frozen=True)
class FilledEntry:
    """One chunk to store that ``fill(view)`` writes where the tier wants it (a writable view
    of exactly ``length`` bytes), rather than bytes to be copied there: for tiers with a
    ``put_filled`` verb. ``fill`` may run more than once (a retry, a replica) and must write
    the same bytes each time; ``depth``/``parent`` as for :class:`Entry`."""

    key: bytes
    length: int
    fill: Callable[[memoryview], None]
    depth: int = 0
    parent: bytes = b""

    def materialize(self) -> Entry:
        """The :class:`Entry` of this chunk, filled into fresh memory (paths that send bytes)."""
        buf = bytearray(self.length)
        self.fill(memoryview(buf))
        return Entry(self.key, buf, self.depth, self.parent)


@dataclass(frozen=True)
class TierUsage:
    """A tier's footprint.

    ``used_bytes`` is the part of ``capacity_bytes`` the chunks held take, counted the way the
    tier bounds itself, so ``used_bytes / capacity_bytes`` reaches 1 exactly when the next
    put of a new chunk must evict: the cpu tier counts whole slots (a 100 KB chunk in a 1 MiB
    slot takes 1 MiB of its capacity), memory and disk their chunk (disk: file) bytes.
    ``chunk_bytes`` is the bytes of the chunks themselves (equal to ``used_bytes`` where the
    tier counts those; built without it, it is set to ``used_bytes``). ``evictions`` counts
    the chunks the tier itself evicted to stay within its capacity since it was built (0 for
    tiers whose bound lives in another process: redis, remote)."""

    name: str
    used_bytes: int
    capacity_bytes: int
    entries: int
    evictions: int = 0
    chunk_bytes: int = -1  # -1: the same as used_bytes (set by __post_init__)

    def __post_init__(self) -> None:
        if self.chunk_bytes < 0:  # why a sentinel: tiers that count chunk bytes need not repeat them
            object.__setattr__(self, "chunk_bytes", self.used_bytes)


EvictListener = Callable[[bytes, bytes], None]
"""Called as ``listener(key, data)`` with a chunk a tier evicts (write-back hands it down).
Runs on the thread that caused the eviction, with the tier's lock released or held as the
tier documents; it must be quick and must not call back into the same tier."""

EvictedKeyListener = Callable[[bytes], None]
"""Called as ``listener(key)`` for every chunk a bounded tier evicts (capacity, policy or an
owner's ``shed``), *with the tier's lock held*: it must be quick (a bounded queue append),
must not raise and must never call into any tier. Unlike :data:`EvictListener` it gets no
bytes, so a disk tier does not read the evicted file for it (kvtier-server's KV events)."""


@runtime_checkable
class Tier(Protocol):
    name: str
    evict_listener: EvictListener | None
    evicted_key_listener: EvictedKeyListener | None

    def probe(self, keys: Sequence[bytes]) -> Probe: ...

    def contains(self, keys: Sequence[bytes]) -> int: ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]: ...

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]: ...

    def put(self, entries: Sequence[Entry]) -> list[bool]:
        """Store ``entries``; their bytes are copied or written before this returns (a tier
        keeps no reference to ``entry.data``: callers may reuse those buffers afterwards,
        see ``TieredStore.keeps_entries``)."""

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def usage(self) -> TierUsage: ...

    def check(self) -> list[str]: ...

    def close(self) -> None: ...


class PrefixOps(Protocol):
    """The read/write verbs of a tier, bound to one prefix (see :class:`PrefixPlaced`)."""

    def probe(self, keys: Sequence[bytes]) -> Probe: ...

    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]: ...

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]: ...

    def put(self, entries: Sequence[Entry]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...


@runtime_checkable
class PrefixPlaced(Protocol):
    """A tier that places chunks by their prefix (the grpc tier puts groups of consecutive
    chunks on the same nodes). ``for_prefix(prefix)`` returns verbs that know each key's depth:
    ``prefix[d]`` is chunk ``d``; every key passed to them must be one of ``prefix``'s (others
    are placed by themselves). The store routes every call through it."""

    def for_prefix(self, prefix: Sequence[bytes]) -> PrefixOps: ...


def bind_prefix(tier: Tier, prefix: Sequence[bytes] | None) -> Tier | PrefixOps:
    """``tier.for_prefix(prefix)`` for a prefix-placed tier, else ``tier`` itself."""
    return tier.for_prefix(prefix) if prefix is not None and isinstance(tier, PrefixPlaced) else tier


def _load_c_probe() -> tuple[Callable[[Sequence[bytes], int], None], Callable[[Container[bytes], Sequence[bytes]], int]] | None:
    """The optional C loops of check_keys and leading_run (kvtier/_probe.c): the same answers,
    a few ns a key instead of ~20. None where it was not built."""
    try:
        from kvtier._probe import check_keys as c_check_keys
        from kvtier._probe import leading_run as c_leading_run
    except ImportError:
        return None
    return c_check_keys, c_leading_run


C_PROBE = _load_c_probe()


def check_keys_python(keys: Sequence[bytes]) -> None:
    """:func:`check_keys` in Python (the C loop must agree with it: tests/test_probe_loops.py)."""
    # One C-level pass (map/set) rather than a Python loop.
    if not set(map(type, keys)) <= {bytes}:
        for key in keys:  # a str of 32 characters has the right len() but is no key
            try:
                memoryview(key)
            except TypeError:
                raise TypeError(f"chunk keys are bytes, got {type(key).__name__}") from None
    lengths = set(map(len, keys))
    if lengths and lengths != {KEY_BYTES}:
        bad = next(n for n in lengths if n != KEY_BYTES)
        raise ValueError(f"chunk keys are {KEY_BYTES} bytes, got one of {bad}")


def leading_run_python(index: Container[bytes], keys: Sequence[bytes]) -> int:
    """:func:`leading_run` in Python: ``takewhile`` into ``list`` runs no bytecode per key."""
    return len(list(itertools.takewhile(index.__contains__, keys)))


def check_keys(keys: Sequence[bytes]) -> None:
    """Raise ValueError unless every key is exactly KEY_BYTES bytes (TypeError: not bytes-like)."""
    # A 128k-token prompt has 512 keys, and every probe of every tier checks them (issue 16's
    # lookup budget): the C loop when built.
    if C_PROBE is not None:
        C_PROBE[0](keys, KEY_BYTES)
    else:
        check_keys_python(keys)


def leading_run(index: Container[bytes], keys: Sequence[bytes]) -> int:
    """How many leading ``keys`` are in ``index`` (a tier's key map; stops at the first miss),
    in C when built, else at C speed through ``takewhile``."""
    if C_PROBE is not None:
        return C_PROBE[1](index, keys)
    return leading_run_python(index, keys)


def copy_into(values: Sequence[bytes | Miss], outs: Sequence[memoryview]) -> list[int | Miss]:
    """``get_into`` from ``get``'s results: copy each hit into its buffer, pass misses through."""
    results: list[int | Miss] = []
    for value, out in zip(values, outs):
        if isinstance(value, Miss):
            results.append(value)
            continue
        if len(value) > out.nbytes:
            raise ValueError(f"buffer of {out.nbytes} bytes is too small for a {len(value)}-byte chunk")
        out[: len(value)] = value
        results.append(len(value))
    return results


class TierBase:
    """Shared plumbing: derived verbs, the closed flag, and the evicted-key memory that lets a
    miss say ``evicted`` rather than ``absent``. Subclasses implement ``_probe``, ``get``,
    ``put``, ``delete``, ``usage`` and optionally ``get_into`` and ``_close``."""

    name = "tier"
    _GHOSTS = 65536  # evicted keys remembered for miss labelling (32 B each: ~2 MiB)

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._closed = False
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()
        self.evict_listener: EvictListener | None = None
        self.evicted_key_listener: EvictedKeyListener | None = None

    # --- derived verbs -------------------------------------------------------------------
    def probe(self, keys: Sequence[bytes]) -> Probe:
        check_keys(keys)
        self._check_open()
        return self._probe(keys)

    def contains(self, keys: Sequence[bytes]) -> int:
        return self.probe(keys).hits

    def get_into(self, keys: Sequence[bytes], outs: Sequence[memoryview]) -> list[int | Miss]:
        if len(keys) != len(outs):
            raise ValueError(f"get_into got {len(keys)} keys and {len(outs)} buffers")
        return copy_into(self.get(keys), outs)

    def check(self) -> list[str]:
        """Invariant violations (empty when healthy); tests call it after every scenario."""
        return []

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._close()

    # --- verbs subclasses implement ---------------------------------------------------------
    def get(self, keys: Sequence[bytes]) -> list[bytes | Miss]:
        raise NotImplementedError

    def _probe(self, keys: Sequence[bytes]) -> Probe:
        raise NotImplementedError

    # --- helpers for subclasses ------------------------------------------------------------

    def _close(self) -> None:
        pass

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"tier {self.name!r} is closed")

    def _remember_evicted(self, key: bytes) -> None:
        if self.evicted_key_listener is not None:
            self.evicted_key_listener(key)
        self._ghosts[key] = None
        if len(self._ghosts) > self._GHOSTS:
            self._ghosts.popitem(last=False)

    def _forget_evicted(self, key: bytes) -> None:
        self._ghosts.pop(key, None)

    def _absent(self, key: bytes) -> Miss:
        return Miss(EVICTED) if key in self._ghosts else Miss(ABSENT)


class BoundedTier(TierBase):
    """A tier that bounds its own bytes with an :class:`EvictionPolicy` (memory, cpu, disk).

    Subclasses set ``capacity_bytes``, ``policy`` and ``_used`` and implement ``_entries``.
    """

    capacity_bytes: int
    policy: EvictionPolicy
    _used: int
    _evictions: int = 0
    _pins: frozenset[bytes] = frozenset()  # replaced (never mutated) by pin/unpin, lock held

    def _entries(self) -> int:
        raise NotImplementedError

    def _size_of(self, key: bytes) -> int:
        """Bytes ``key``'s chunk counts against the capacity, 0 when not held (lock held).
        Byte-bounded tiers (memory, disk) implement it for :meth:`_unfittable`; the cpu
        tier's slots always fit one chunk beside any pins, so it never asks."""
        raise NotImplementedError

    def _unfittable(self, size: int) -> bool:
        """True when ``size`` more bytes cannot fit even after every unpinned chunk is gone:
        the put is refused before anything is evicted, not after the whole unpinned cache
        was thrown away for nothing. Lock held; O(pins), so callers ask only when a put must
        evict and something is pinned."""
        pinned = sum(self._size_of(key) for key in self._pins)
        return size > self.capacity_bytes - pinned

    def _pick_victim(self) -> bytes:
        """The policy's next victim, counted in ``usage().evictions``. Call under the lock;
        raises :class:`~kvtier.policies.NothingToEvict` as the policy does."""
        victim = self.policy.evict()
        self._evictions += 1
        return victim

    def pin(self, keys: Sequence[bytes]) -> None:
        """Never evict ``keys`` (hot system prompts) until :meth:`unpin`."""
        with self._lock:
            for key in keys:
                self.policy.pin(key)
            self._pins = self._pins.union(keys)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self.policy.unpin(key)
            self._pins = self._pins.difference(keys)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(self.name, self._used, self.capacity_bytes, self._entries(), self._evictions)

    @property
    def used_bytes(self) -> int:
        """``usage().used_bytes`` without the lock or the snapshot, for an owner that reads it
        on every put (kvtier-server's shared pool): one int, so a put racing this read is
        either counted or not, never half."""
        return self._used

"""Dueling eviction (``"dueling"``): ``adaptive`` or ``s3fifo``, whichever miniature
simulations of both say wins on the workload running now. The default policy.

Why. ``adaptive`` (:mod:`kvtier.policies.adaptive`) learns ARC-style between once-seen-first
and recency and wins on the shared trace, RAG and agents; it shares ARC's weakness on cyclic
reuse just larger than the cache: the ghost history makes every returning key "re-used", the
re-used set is ranked by recency, and the cache thrashes like LRU. Round-robin serving of
sessions or agents and repeated passes over a corpus are that workload, and there S3-FIFO
(:mod:`kvtier.policies.s3fifo`), which gives no ghost to keys evicted from its main queue, keeps
most of its main queue across passes: a loop of 8-block prompts over 90% of its blocks hit 0.35
(adaptive) against 0.67 (s3fifo); the generated chat at 10% 0.215 against 0.306. On other
workloads s3fifo loses by as much (the trace at 10%: 0.284 against 0.261). Neither parameter
tuning nor a rule change in ``adaptive`` recovered the loops without losing elsewhere.

How (miniature simulation, Waldspurger et al., ATC '17):

1. **Both mains run.** Both policies track every key (each insert, access, remove, pin goes to
   both); the *leader* picks each victim and the other forgets it. So a change of leader needs
   no rebuild and loses neither policy's history (an earlier rebuild-on-switch lost adaptive's
   ghosts and cost ~2 points on the trace each time).
2. **Two miniatures.** A fixed sample of the keys (``crc32(key) % div == 0``; ``div`` a power of
   two up to 16, fixed at the first eviction so that each miniature holds at least ``floor``
   keys) also drives a small ``adaptive`` and a small ``s3fifo``, each holding ``len / div``
   keys. A sampled key's parent in a miniature is its nearest sampled ancestor. A reference is
   a miniature *hit* when the key is there and the request's previous sampled key was a hit
   too: the leading-run rule of ``Tier.contains`` on the sample.
3. **Decision.** Hits decay by ``1 - 1 / (window * mini size)`` per sampled reference; the
   other policy leads once its score beats the leader's by ``margin``, 4 hits and ``z``
   standard deviations of the two counts (Poisson noise: without it, the sample's noise made
   the leader change back and forth on the trace, each change costing a few hits), at most
   once per ``dwell * mini size`` sampled references.

Cost: two main policies, about 2/``div`` more miniature calls, and one dict entry per key (its
nearest sampled ancestor); ``python bench/replay.py`` reports ``dueling_s_per_mop``. Until the
first eviction nothing is sampled and ``adaptive`` leads. Purity, determinism (crc32, not
Python's salted ``hash``), threads and pins as in :mod:`kvtier.policies.base`; the miniatures
ignore pins (a pinned key is one the main policies never evict).
"""

from __future__ import annotations

import zlib
from typing import Protocol

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.base import EvictionPolicy, NothingToEvict
from kvtier.policies.s3fifo import S3FIFOPolicy

MARGIN = 0.03
Z = 2.0  # and by this many standard deviations of the hit counts (Poisson noise)
WINDOW = 4.0  # hits decay over this many miniature sizes of sampled references
DWELL = 2.0  # and the leader changes at most once per this many
FLOOR = 512  # keys each miniature holds at least (else a larger sample)
MAX_DIV = 16  # a sample of at least 1/16 of the keys
_MISS = b"-"  # no key: the previous sampled reference missed


class Candidate(EvictionPolicy, Protocol):
    def forget_evicted(self, key: bytes) -> None:
        """Another policy tracking the same keys evicted ``key``: forget it as an eviction."""


def _candidates() -> tuple[Candidate, Candidate]:
    return AdaptivePolicy(), S3FIFOPolicy()


class DuelingPolicy:
    name = "dueling"

    def __init__(self, margin: float = MARGIN, window: float = WINDOW, dwell: float = DWELL,
                 floor: int = FLOOR, z: float = Z) -> None:
        self.margin, self.window, self.dwell, self.floor, self.z = margin, window, dwell, floor, z
        self._mains = _candidates()
        self.leader = 0  # index into the candidates: 0 adaptive, 1 s3fifo
        self._minis = _candidates()
        self._anc: dict[bytes, bytes] = {}  # tracked key -> nearest sampled ancestor (b"": none)
        self._info: dict[bytes, tuple[int, int]] = {}  # sampled tracked key -> (size, depth)
        self._div = 0  # sampling divisor, fixed at the first eviction (0: nothing sampled yet)
        self._score = [0.0, 0.0]
        self._prev_hit = [_MISS, _MISS]
        self._refs = 0  # sampled references seen
        self._changed_at = 0
        self.leader_changes = 0

    @property
    def leader_name(self) -> str:
        return self._mains[self.leader].name

    def _sampled(self, key: bytes) -> bool:
        return self._div > 0 and zlib.crc32(key) % self._div == 0

    # --- the contract ---------------------------------------------------------------------
    def insert(self, key: bytes, size: int, depth: int = 0, parent: bytes = b"") -> None:
        for main in self._mains:
            main.insert(key, size, depth, parent)
        anc = self._anc.get(key)
        if anc is None:
            parent_anc = self._anc.get(parent) if parent else None
            anc = b"" if parent_anc is None else (parent if self._sampled(parent) else parent_anc)
            self._anc[key] = anc
        if self._sampled(key):
            self._info[key] = (size, depth)
            self._reference(key, anc, size, depth)

    def access(self, key: bytes) -> None:
        anc = self._anc.get(key)
        if anc is None:
            return
        for main in self._mains:
            main.access(key)
        info = self._info.get(key)
        if info is not None:
            self._reference(key, anc, *info)

    def remove(self, key: bytes) -> None:
        if self._anc.pop(key, None) is None:
            return
        self._info.pop(key, None)
        for policy in (*self._mains, *self._minis):
            policy.remove(key)

    def evict(self) -> bytes:
        if not self._div:
            self._div = 1
            while self._div < MAX_DIV and len(self._anc) // (2 * self._div) >= self.floor:
                self._div *= 2
        victim = self._mains[self.leader].evict()  # NothingToEvict: every tracked key is pinned
        self._mains[1 - self.leader].forget_evicted(victim)
        self._anc.pop(victim, None)
        self._info.pop(victim, None)
        return victim

    def pin(self, key: bytes) -> None:
        for main in self._mains:
            main.pin(key)

    def unpin(self, key: bytes) -> None:
        for main in self._mains:
            main.unpin(key)

    def __contains__(self, key: object) -> bool:
        return key in self._anc

    def __len__(self) -> int:
        return len(self._anc)

    # --- the miniatures -------------------------------------------------------------------
    def _reference(self, key: bytes, anc: bytes, size: int, depth: int) -> None:
        """A sampled key was read or written: each miniature hits or takes it in."""
        cap = max(1, len(self._anc) // self._div)
        keep = 1.0 - 1.0 / (self.window * cap)
        self._refs += 1
        for i, mini in enumerate(self._minis):
            self._score[i] *= keep
            if key in mini and (not anc or self._prev_hit[i] == anc):
                self._score[i] += 1.0
                self._prev_hit[i] = key
                mini.access(key)
                continue
            self._prev_hit[i] = _MISS
            if key not in mini:
                while len(mini) >= cap:
                    try:
                        mini.evict()
                    except NothingToEvict:
                        break
            mini.insert(key, size, depth, anc)
        other = 1 - self.leader
        mine, theirs = self._score[self.leader], self._score[other]
        if (self._refs - self._changed_at > self.dwell * cap
                and theirs > mine * (1.0 + self.margin) + 4.0 + self.z * (mine + theirs) ** 0.5):
            self.leader = other
            self._changed_at = self._refs
            self.leader_changes += 1

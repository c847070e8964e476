"""Load or recompute: how many leading hit tokens a request should restore.

A restore pays off only while it is faster than computing the same tokens again (SGLang users
measured a remote hit at 2,450 ms TTFT against 1,725 ms for recompute, sglang#26305). This
module estimates both sides online and cuts each hit where loading stops winning.

Model
    load of a tier's run      ``fixed_t + bytes * seconds_per_byte_t``   (once per tier touched)
    recompute of n tokens     ``n * seconds_per_token``   (the engine's marginal prefill cost)
``TierFit`` fits a tier's two numbers from measured restores (exponentially weighted least
squares over (bytes, seconds)); ``PrefillFit`` fits the engine's per-step overhead and
per-token cost from measured forward steps (tokens computed, seconds). Until a side is
measured it uses a prior: optimistic for tiers (so an unmeasured tier is tried, then known) and
a slow prefill (so nothing is skipped before the engine's own speed is known).

Decision (``plan``): the hit is a sequence of runs (tier, chunks) in prefix order. Within one
run the saving grows or shrinks linearly with its length, so the best cut is at a run end (or
before the run): ``plan`` takes the run end with the largest estimated saving, none if loading
saves nothing. A tier judged too slow is no longer read and so no longer measured: once its
newest sample is old enough, one chunk of it is loaded again (a probe) to see whether it got
faster. A probe of a tier still slow costs the request it rides on that chunk's load time less
its recompute time, so "old enough" is at least ``reprobe_s`` and at least that cost divided by
``probe_share``: probes of a slow tier take at most that share of the time (a chunk 3 s slower
than recompute is probed every 150 s, not every 10 s: on a ~11 s prefill a 10 s period put a
probe in every request, 1.21x TTFT, bench/e2e_vllm.py ``slow_tier_ttft_ratio``).

``plan`` and the fits are pure (no I/O, no engine, no clock: callers pass ``now``).
``CostModel`` holds the worker's estimates and is thread-safe: the worker's forward thread feeds
it, its lookup threads ask it (``cut``, which reads the monotonic clock).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# (fixed seconds per load, bytes per second) assumed for a tier before it is measured.
_FAST = (1e-4, 8e9)
TIER_PRIORS: Mapping[str, tuple[float, float]] = {
    "gpu": (5e-5, 2e10), "cpu": _FAST, "memory": _FAST, "disk": (5e-4, 2e9)}
OTHER_TIER_PRIOR = (2e-3, 1e9)  # remote tiers (grpc, redis) and any other
PREFILL_PRIOR_TOKENS_PER_S = 5000.0
PROBE_SHARE = 0.02        # probes of a slow tier cost at most this share of the time between them
SMALL_STEP_TOKENS = 32    # a step this small is mostly per-step overhead (decode)
LARGE_STEP_TOKENS = 128   # a step this large measures the per-token cost
OUTLIER_FACTOR = 3.0      # one sample moves a fit by at most this times its prediction


class TierFit:
    """``seconds = fixed + bytes * per_byte``, fitted from (bytes, seconds) samples.

    Exponentially weighted sums (``alpha``: weight of the newest sample) give a least-squares
    line while the samples' sizes differ enough; with one size only, the prior's fixed cost
    (at most half the mean time) is kept and the rest is bandwidth, so the fit is exact at the
    size seen. From the third sample on, a slow sample is clipped to ``OUTLIER_FACTOR`` times
    the prediction (one stall on a shared machine must not condemn a tier), and a sample that
    fast restarts the fit (noise does not make reads faster)."""

    def __init__(self, prior: tuple[float, float], alpha: float = 0.3) -> None:
        self.prior_fixed, self.prior_per_byte = prior[0], 1.0 / prior[1]
        self.alpha = alpha
        self.n = 0
        self.last = float("-inf")   # time of the newest sample (or probe)
        self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, nbytes: float, seconds: float, now: float) -> None:
        if nbytes <= 0 or seconds < 0:
            return
        if self.n and seconds * OUTLIER_FACTOR < self.predict(nbytes):
            # Noise only ever slows a read down: a much faster one is what the medium does now
            # (it recovered, or a probe found it fast). Start over from it.
            self.n = 0
            self._w = self._sx = self._sy = self._sxx = self._sxy = 0.0
        elif self.n >= 2:
            seconds = min(seconds, OUTLIER_FACTOR * self.predict(nbytes))
        keep = 1.0 - self.alpha
        self._w = self._w * keep + 1.0
        self._sx = self._sx * keep + nbytes
        self._sy = self._sy * keep + seconds
        self._sxx = self._sxx * keep + nbytes * nbytes
        self._sxy = self._sxy * keep + nbytes * seconds
        self.n += 1
        self.last = now

    def params(self) -> tuple[float, float]:
        """(fixed seconds, seconds per byte)."""
        if self.n == 0:
            return self.prior_fixed, self.prior_per_byte
        mx, my = self._sx / self._w, self._sy / self._w
        var = self._sxx / self._w - mx * mx
        if var > (0.05 * mx) ** 2:
            slope = (self._sxy / self._w - mx * my) / var
            fixed = my - slope * mx
            if slope > 0 and fixed >= 0:
                return fixed, slope
        fixed = min(self.prior_fixed, 0.5 * my)
        return fixed, max(my - fixed, 0.0) / mx

    def predict(self, nbytes: float) -> float:
        fixed, per_byte = self.params()
        return fixed + nbytes * per_byte


class PrefillFit:
    """The engine's forward step: ``seconds = overhead + tokens * per_token``.

    Small steps (decode) update the overhead, large steps the per-token cost (never crediting
    more than half a large step's time to overhead); both are exponentially weighted."""

    def __init__(self, prior_tokens_per_s: float = PREFILL_PRIOR_TOKENS_PER_S, alpha: float = 0.2) -> None:
        self.per_token = 1.0 / prior_tokens_per_s
        self.overhead = 0.0
        self.alpha = alpha
        self.large_steps = 0

    def add(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        a = self.alpha
        if tokens <= SMALL_STEP_TOKENS:
            self.overhead += a * (max(seconds - tokens * self.per_token, 0.0) - self.overhead)
        elif tokens >= LARGE_STEP_TOKENS:
            sample = max(seconds - self.overhead, 0.5 * seconds) / tokens
            if self.large_steps >= 2:
                sample = min(sample, OUTLIER_FACTOR * self.per_token)
            w = 1.0 if self.large_steps == 0 else a  # the first measurement replaces the prior
            self.per_token += w * (sample - self.per_token)
            self.large_steps += 1


@dataclass(frozen=True)
class TierCost:
    fixed_s: float
    s_per_byte: float
    age_s: float = 0.0    # since its newest sample (or probe); 0 for a tier never measured


@dataclass(frozen=True)
class Costs:
    """A snapshot of the estimates ``plan`` decides with."""

    s_per_token: float
    tiers: Mapping[str, TierCost]
    reprobe_s: float = 10.0
    probe_share: float = PROBE_SHARE

    def probe_due(self, cost: TierCost, extra_s: float) -> bool:
        """Whether a skipped tier measured ``cost.age_s`` ago is probed, when the probe adds
        ``extra_s`` seconds to the request should the tier still be as slow as estimated."""
        return cost.age_s > 0 and cost.age_s >= max(self.reprobe_s, extra_s / self.probe_share)

    def tier(self, name: str) -> TierCost:
        got = self.tiers.get(name)
        if got is not None:
            return got
        fixed, bps = TIER_PRIORS.get(name, OTHER_TIER_PRIOR)
        return TierCost(fixed, 1.0 / bps)


@dataclass(frozen=True)
class LoadDecision:
    """Load tokens ``[start, end)``; ``skipped`` hit tokens after ``end`` are recomputed
    because loading them is estimated slower. ``probe``: the slow tier one chunk is read from
    to measure it again ("" if none)."""

    end: int
    skipped: int
    load_s: float
    recompute_s: float
    probe: str = ""


def plan(runs: Sequence[tuple[str, int]], *, start: int, usable: int, chunk_tokens: int,
         chunk_bytes: int, costs: Costs) -> LoadDecision:
    """Cut the hit ``[start, usable)`` (token offsets; ``runs`` cover chunks from chunk 0).

    ``start`` and ``usable`` are engine-block aligned; the cut is ``start``, ``usable`` or a run
    end between them. Chunks are read whole, so a run's bytes count every chunk it overlaps."""
    c = chunk_tokens
    if usable <= start:
        return LoadDecision(start, 0, 0.0, 0.0)
    best_end, best_gain, best_load = start, 0.0, 0.0
    load, pos = 0.0, 0
    for tier, n in runs:
        lo, hi = pos * c, (pos + n) * c
        pos += n
        a, b = max(lo, start), min(hi, usable)
        if b <= a:
            continue
        cost = costs.tier(tier)
        load += cost.fixed_s + (-(-b // c) - a // c) * chunk_bytes * cost.s_per_byte
        gain = (b - start) * costs.s_per_token - load
        if gain > best_gain:
            best_end, best_gain, best_load = b, gain, load
    next_tier = _tier_at(runs, best_end // c) if best_end < usable else ""
    if next_tier:
        probe_end = min(usable, (best_end // c + 1) * c)
        cost = costs.tier(next_tier)
        probe_s = cost.fixed_s + chunk_bytes * cost.s_per_byte
        if costs.probe_due(cost, probe_s - (probe_end - best_end) * costs.s_per_token):
            return LoadDecision(probe_end, usable - probe_end, best_load + probe_s,
                                (probe_end - start) * costs.s_per_token, next_tier)
    return LoadDecision(best_end, usable - best_end, best_load, (best_end - start) * costs.s_per_token)


def _tier_at(runs: Sequence[tuple[str, int]], chunk: int) -> str:
    pos = 0
    for tier, n in runs:
        pos += n
        if chunk < pos:
            return tier
    return ""


class CostModel:
    """The worker's online estimates: tiers from restores, prefill from forward steps.

    Threads: any (one lock). ``step_begin``/``step_end`` bracket one forward pass on the
    forward thread."""

    def __init__(self, reprobe_s: float = 10.0,
                 prefill_prior_tokens_per_s: float = PREFILL_PRIOR_TOKENS_PER_S,
                 probe_share: float = PROBE_SHARE) -> None:
        self.reprobe_s = reprobe_s
        self.probe_share = probe_share
        self.prefill = PrefillFit(prefill_prior_tokens_per_s)
        self._tiers: dict[str, TierFit] = {}
        self._lock = threading.Lock()
        self._step: tuple[int, float] | None = None

    def _fit(self, tier: str) -> TierFit:
        fit = self._tiers.get(tier)
        if fit is None:
            fit = self._tiers[tier] = TierFit(TIER_PRIORS.get(tier, OTHER_TIER_PRIOR))
        return fit

    def observe_load(self, chunks_by_tier: Mapping[str, int], nbytes: int, seconds: float,
                     now: float) -> None:
        """One restore read ``nbytes`` in ``seconds``. A mixed-tier one is split between its
        tiers by what each was predicted to take: in proportion when it was faster than
        predicted, else the excess goes to the tier predicted slowest (the likely culprit:
        a cpu tier does not turn slow, a remote one does)."""
        total = sum(chunks_by_tier.values())
        if total <= 0 or nbytes <= 0:
            return
        with self._lock:
            shares = {t: nbytes * n / total for t, n in chunks_by_tier.items() if n > 0}
            pred = {t: self._fit(t).predict(b) for t, b in shares.items()}
            whole = sum(pred.values()) or 1.0
            if seconds <= whole:
                split = {t: seconds * p / whole for t, p in pred.items()}
            else:
                split = dict(pred)
                slowest = max(pred, key=pred.__getitem__)
                split[slowest] += seconds - whole
            for t, b in shares.items():
                self._fit(t).add(b, split[t], now)

    def step_begin(self, tokens: int, now: float) -> None:
        self._step = (tokens, now)

    def step_end(self, now: float, *, measured: bool = True) -> None:
        """End of the forward pass begun by ``step_begin``; ``measured=False`` drops the
        sample (the step also waited on a restore)."""
        step, self._step = self._step, None
        if step is not None and measured:
            with self._lock:
                self.prefill.add(step[0], now - step[1])

    def costs(self, now: float) -> Costs:
        with self._lock:
            tiers = {}
            for name, fit in self._tiers.items():
                fixed, per_byte = fit.params()
                tiers[name] = TierCost(fixed, per_byte, max(now - fit.last, 1e-9) if fit.n > 0 else 0.0)
            return Costs(self.prefill.per_token, tiers, self.reprobe_s, self.probe_share)

    def decide(self, runs: Sequence[tuple[str, int]], *, start: int, usable: int, chunk_tokens: int,
               chunk_bytes: int, now: float) -> LoadDecision:
        """``plan`` with the current estimates; a probe counts as the tier's newest sample
        (so concurrent requests do not all probe it)."""
        decision = plan(runs, start=start, usable=usable, chunk_tokens=chunk_tokens,
                        chunk_bytes=chunk_bytes, costs=self.costs(now))
        if decision.probe:
            with self._lock:
                self._fit(decision.probe).last = now
        return decision

    def answer(self, runs: Sequence[tuple[str, int]], start: int, usable: int, chunk_tokens: int,
               chunk_bytes: int, *, cut: bool = True) -> tuple[int, int, dict[str, int], float]:
        """For a lookup answer: (end of the part to load, hit tokens skipped for speed, chunks
        per tier from chunk 0 up to that end, estimated seconds to load it). ``cut=False``
        loads the whole hit and only estimates it (``load_decision: always``)."""
        costs = self.costs(time.monotonic())
        if cut and usable > start:
            d = self.decide(runs, start=start, usable=usable, chunk_tokens=chunk_tokens,
                            chunk_bytes=chunk_bytes, now=time.monotonic())
            start_end = d.end
        else:
            start_end = usable
        load_s = load_seconds(runs, start=start, end=start_end, chunk_tokens=chunk_tokens,
                              chunk_bytes=chunk_bytes, costs=costs)
        return start_end, usable - start_end, tiers_upto(runs, -(-start_end // chunk_tokens)), load_s


def load_seconds(runs: Sequence[tuple[str, int]], *, start: int, end: int, chunk_tokens: int,
                 chunk_bytes: int, costs: Costs) -> float:
    """Estimated time to read the chunks holding tokens ``[start, end)``."""
    c, pos, total = chunk_tokens, 0, 0.0
    for tier, n in runs:
        a, b = max(pos * c, start), min((pos + n) * c, end)
        pos += n
        if a < b:
            cost = costs.tier(tier)
            total += cost.fixed_s + (-(-b // c) - a // c) * chunk_bytes * cost.s_per_byte
    return total


def tiers_upto(runs: Sequence[tuple[str, int]], chunks: int) -> dict[str, int]:
    """Chunks per tier among the first ``chunks`` of the runs."""
    out: dict[str, int] = {}
    left = chunks
    for tier, n in runs:
        take = min(n, left)
        if take <= 0:
            break
        out[tier] = out.get(tier, 0) + take
        left -= take
    return out

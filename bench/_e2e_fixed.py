"""The fixed cost of a restore: one-chunk prefixes (bench/e2e_vllm.py's ``restore_fixed_ms_*``).

A restore costs a per-request part (the scheduler's lookup round trip to the worker, the
tier's per-call cost, an async load's extra engine steps, per-chunk Python) and a per-byte part.
Long prefixes hide the first; on a GPU, where prefill is fast, it dominates. Here each figure is
a prompt whose only hit is one kvtier chunk, timed like ``Bench.warm``: save the chunk, time a
new question while vLLM's own prefix cache holds it (the floor), reset that cache, time another
question (now restored by kvtier). ``restore_fixed_ms_<tier>`` = the median over the pairs of
warm - floor, in milliseconds: each warm TTFT is paired with the floor taken just before it, in
the same engine and second, so the machine's load drift cancels within a pair. (A difference
of two medians, taken over minutes, went negative on this 2-core machine: the few ms sought
are smaller than the drift.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from bench._stats import Stats

CHUNK = 256  # the bench engines' chunk_tokens (kvtier's default)


class _Bench(Protocol):
    question: int
    reps: int

    def tokens(self, n: int) -> list[int]: ...

    def ttft(self, rep: Any, tokens: list[int]) -> tuple[float, dict[str, Any]]: ...


def one_chunk_restores(b: _Bench, rep: Any, tier: str, settle: Callable[[int], None]
                       ) -> tuple[list[float], list[float]]:
    """(warm, floor) TTFTs in seconds, ``3 * b.reps`` each (a few ms out of a noisy TTFT: the
    runs are short, take more); ``settle(n)`` waits until ``n`` more chunks are stored in
    ``tier``. Raises RuntimeError when a restore is not a one-chunk ``tier`` hit (the figure
    would be meaningless)."""
    warm: list[float] = []
    floor: list[float] = []
    for _ in range(3 * b.reps):
        prefix = b.tokens(CHUNK)
        b.ttft(rep, prefix + b.tokens(b.question))
        settle(1)
        t, out = b.ttft(rep, prefix + b.tokens(b.question))
        if out["num_cached_tokens"] < CHUNK:
            raise RuntimeError(f"one-chunk {tier}: vLLM's prefix cache missed ({out['num_cached_tokens']})")
        floor.append(t)
        rep.call({"op": "reset_prefix_cache"})
        t, out = b.ttft(rep, prefix + b.tokens(b.question))
        kv = out.get("kvtier") or {}
        if kv.get("hit_tokens") != CHUNK or tier not in kv.get("hit_chunks_by_tier", {}):
            raise RuntimeError(f"one-chunk {tier}: expected a one-chunk {tier} hit, got {kv}")
        warm.append(t)
    return warm, floor


def fixed_ms(warm: list[float], floor: list[float]) -> Stats:
    """min/median/max over the (warm, floor) pairs of warm - floor, in ms."""
    return Stats.of([1e3 * (w - f) for w, f in zip(warm, floor, strict=True)])

"""Never slower than recompute: TTFT with kvtier over a tier slower than the engine's prefill
(bench/e2e_vllm.py's ``slow_tier_ttft_ratio``, issue 19 item 2; target <= 1.05).

A kvtier engine (``slow``) keeps everything in one FaultyTier whose reads are throttled through a
control file (tests/vllm_throttled.py) so that loading a prefix takes THROTTLE_X times as long
as the plain engine's measured prefill of it, with kvtier's default load decision (``auto``:
load only what beats recomputing, from each tier's bandwidth measured online). The first hit
is loaded (the prior is optimistic) and teaches the connector that the tier is slow; it is
reported (``slow_tier_learn_s``), not counted. Then each rep saves a fresh prefix through the
slow engine, resets its vLLM prefix cache, and times one prompt on that prefix on both
engines, in alternating order (the plain engine has never seen the prefix: both compute it,
unless kvtier loads). ``slow_tier_ttft_ratio`` is the median of the per-rep ratios slow/plain;
min/median/max are printed. A rep where the connector re-probes the tier (one chunk, every
``reprobe_s``) is counted as it comes: that probe is the price of noticing the tier got fast.
``slow_tier_skipped_tokens``: the tokens kvtier held but chose to recompute, per rep.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Protocol

from kvtier_hf.random_llama import TinyLlamaSpec

from bench._e2e_save import pair_line, pair_ratios
from bench._stats import Stats, fmt
from tests.vllm_model import kv_bytes
from tests.vllm_replica import Replica
from tests.vllm_throttled import CONTROL_ENV

THROTTLE_X = 4.0  # loading the prefix from the slow tier takes this many prefills


class _Bench(Protocol):
    spec: TinyLlamaSpec
    model: str
    work: Path
    prefix: int
    question: int
    reps: int
    max_len: int

    def tokens(self, n: int) -> list[int]: ...

    def ttft(self, rep: Replica, tokens: list[int]) -> tuple[float, dict[str, Any]]: ...


def slow_tier_phase(b: _Bench, plain: Replica) -> dict[str, Any]:
    """Runs the phase against ``plain`` (no kvtier); returns its JSON keys. Raises RuntimeError
    when the slow engine's hit is missing (the figure would be meaningless)."""
    control = b.work / "slow-tier-throttle"
    control.write_text("0")
    opts = {"model": b.model, "kvtier": {"chunk_tokens": 256}, "connector_module": "tests.vllm_throttled",
            "env": {CONTROL_ENV: str(control)}, "prefix_caching": True,
            "max_model_len": b.max_len, "max_num_batched_tokens": b.max_len}
    slow = Replica(opts, b.work / "slow.log", timeout_s=600)
    try:
        slow.generate([{"tokens": b.tokens(300)}], max_tokens=2)  # kernel warm-up
        prefill = statistics.median(b.ttft(plain, b.tokens(b.prefix) + b.tokens(b.question))[0]
                                    for _ in range(3))
        bps = kv_bytes(b.prefix, b.spec) / (THROTTLE_X * prefill)
        control.write_text(str(bps))
        learn = _one_rep(b, slow, None)[0]
        ttft_slow: list[float] = []
        ttft_plain: list[float] = []
        skipped: list[int] = []
        for i in range(b.reps):
            t_slow, t_plain, kv = _one_rep(b, slow, plain, plain_first=i % 2 == 1)
            ttft_slow.append(t_slow)
            ttft_plain.append(t_plain)
            skipped.append(int(kv.get("skipped_tokens", 0)))
    finally:
        slow.close()
    print(f"slow tier: {bps / 1e6:.1f} MB/s (prefix load = {THROTTLE_X:g} x prefill {prefill:.3f} s); "
          f"learning hit {learn:.3f} s")
    print(f"TTFT, kvtier over the slow tier    {fmt(ttft_slow, 's', 3)}")
    print(f"TTFT, plain engine (same prompts)  {fmt(ttft_plain, 's', 3)}")
    print(f"  slow tier / plain, per rep       {pair_line(ttft_slow, ttft_plain)}")
    print(f"  tokens skipped for speed per rep {skipped}")
    pairs = Stats.of(pair_ratios(ttft_slow, ttft_plain))
    return {"slow_tier_ttft_ratio": pairs.median, "slow_tier_ttft_ratio_pairs": vars(pairs),
            "slow_tier_learn_s": learn, "slow_tier_read_bps": bps, "slow_tier_skipped_tokens": skipped,
            "runs_slow_tier": {"ttft_slow_s": ttft_slow, "ttft_plain_s": ttft_plain}}


def _one_rep(b: _Bench, slow: Replica, plain: Replica | None, plain_first: bool = False
             ) -> tuple[float, float, dict[str, Any]]:
    """Save a fresh prefix through ``slow``, drop it from slow's vLLM cache, then time one prompt
    on it on both engines (``plain`` None: on ``slow`` only, plain s 0): (slow s, plain s,
    slow's kvtier stats)."""
    prefix = b.tokens(b.prefix)
    b.ttft(slow, prefix + b.tokens(b.question))
    time.sleep(0.5)  # the save is asynchronous
    slow.call({"op": "reset_prefix_cache"})
    prompt = prefix + b.tokens(b.question)
    times: dict[str, float] = {"plain": 0.0}
    kv: dict[str, Any] = {}
    engines = [("plain", plain), ("slow", slow)] if plain is not None else [("slow", slow)]
    for name, rep in engines[:: 1 if plain_first else -1]:
        times[name], out = b.ttft(rep, prompt)
        if name == "slow":
            kv = out.get("kvtier") or {}
            held = int(kv.get("hit_tokens", 0)) + int(kv.get("skipped_tokens", 0))
            if held < b.prefix - 256:
                raise RuntimeError(f"slow tier: kvtier did not find the saved prefix ({kv})")
    return times["slow"], times["plain"], kv

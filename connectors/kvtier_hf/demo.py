"""``kvtier demo``: a real engine reuses a long shared prefix across processes.

Two phases over the same prompt (a long shared prefix followed by a question):

- cold, in this process: nothing is cached; the whole prompt is prefilled, its K/V chunks are
  saved (cpu tier, written through to a disk tier in a temporary directory), then greedy decode.
- warm, in a *fresh* process (``python -m kvtier.cli demo --_phase warm``; ``demo`` reaches the
  CLI through this package's ``kvtier.commands`` entry point) sharing only that directory (or
  a kvtier-server with ``--server``): the prefix is restored from the store, only the last
  prompt token is prefilled, and the greedy output must equal the cold one.

The engine is transformers with a random-weight Llama built from a config (no download);
torch and the connector are imported when a phase runs, not when this module is.
Both phases run the same warm-up forward first so that one-off costs (thread pools, kernel
selection) stay out of the time-to-first-token (TTFT) figures.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import CpuTierConfig, DiskTierConfig, GrpcTierConfig, KVTierConfig, MiB
from kvtier_hf.read_limit import RestorePairs, measure_pairs, serving_tier

log = logging.getLogger(__name__)

PHASE_TIMEOUT_S = 600.0
RESTORE_PAIRS = 5  # (restore, read) pairs after the warm phase's generate (read_limit.py)


@dataclass(frozen=True)
class DemoOptions:
    prefix_tokens: int = 3072
    question_tokens: int = 64
    new_tokens: int = 16
    # 128 tokens of the demo model = 2 MiB per chunk: fits the 4 MiB slots that cpu tiers and
    # kvtier-server use by default.
    chunk_tokens: int = 128
    preset: str = "demo"
    seed: int = 0
    dir: str | None = None
    server: str | None = None

    def __post_init__(self) -> None:
        for name in ("prefix_tokens", "question_tokens", "new_tokens", "chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def argv(self) -> list[str]:
        """Command-line flags that reproduce these options (for the warm-phase process)."""
        out = ["--prefix-tokens", str(self.prefix_tokens), "--question-tokens", str(self.question_tokens),
               "--new-tokens", str(self.new_tokens), "--chunk-tokens", str(self.chunk_tokens),
               "--preset", self.preset, "--seed", str(self.seed)]
        if self.dir:
            out += ["--dir", self.dir]
        if self.server:
            out += ["--server", self.server]
        return out


@dataclass(frozen=True)
class PhaseResult:
    """What one phase measured. ``hits_per_tier`` counts chunks served by each tier."""

    phase: str
    tokens: list[int]
    prompt_tokens: int
    restored_tokens: int
    prefilled_tokens: int
    saved_chunks: int
    hits_per_tier: dict[str, int]
    ttft_s: float
    restore_s: float
    prefill_s: float
    decode_s: float
    setup_s: float
    model: str
    tiers: list[str]
    restore_bytes: int = 0  # chunk bytes the restore read
    # (restore, read) pairs after the timed generate (read_limit.py): GB/s of each side
    pair_restore_gbps: list[float] = field(default_factory=list)
    pair_read_gbps: list[float] = field(default_factory=list)
    pid: int = field(default_factory=os.getpid)

    @classmethod
    def from_json(cls, line: str) -> PhaseResult:
        return cls(**json.loads(line))


@dataclass(frozen=True)
class DemoReport:
    cold: PhaseResult
    warm: PhaseResult
    options: DemoOptions
    elapsed_s: float

    @property
    def outputs_identical(self) -> bool:
        return self.cold.tokens == self.warm.tokens

    @property
    def restore_gbps(self) -> float:
        w = self.warm
        return w.restore_bytes / w.restore_s / 1e9 if w.restore_s > 0 else 0.0

    @property
    def pairs(self) -> RestorePairs:
        w = self.warm
        tier = serving_tier(w.hits_per_tier) if w.hits_per_tier else ""
        return RestorePairs(tier, tuple(w.pair_restore_gbps), tuple(w.pair_read_gbps))

    @property
    def tier_read_gbps(self) -> float:
        """The serving tier's own read of the restored chunks, median of the pairs' reads."""
        reads = self.warm.pair_read_gbps
        return statistics.median(reads) if reads else 0.0

    @property
    def speedup(self) -> float:
        return self.cold.ttft_s / self.warm.ttft_s if self.warm.ttft_s > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill_tokens_saved": self.warm.restored_tokens,
            "ttft_cold_s": round(self.cold.ttft_s, 4),
            "ttft_warm_s": round(self.warm.ttft_s, 4),
            "speedup": round(self.speedup, 2),
            "outputs_identical": self.outputs_identical,
            "hits_per_tier": self.warm.hits_per_tier,
            "prompt_tokens": self.cold.prompt_tokens,
            "prefilled_tokens_cold": self.cold.prefilled_tokens,
            "prefilled_tokens_warm": self.warm.prefilled_tokens,
            "saved_chunks_cold": self.cold.saved_chunks,
            "restore_warm_s": round(self.warm.restore_s, 4),
            "restore_gbps": round(self.restore_gbps, 3),
            "tier_read_gbps": round(self.tier_read_gbps, 3),
            "restore_vs_tier_read": round(self.pairs.ratio, 3) if self.pairs.ratios else None,
            "restore_vs_tier_read_pairs": [round(r, 3) for r in self.pairs.ratios],
            "first_restore_vs_tier_read": (round(self.restore_gbps / self.tier_read_gbps, 3)
                                           if self.tier_read_gbps > 0 else None),
            "new_tokens": len(self.warm.tokens),
            "tokens_cold": self.cold.tokens,
            "tokens_warm": self.warm.tokens,
            "model": self.cold.model,
            "tiers": self.warm.tiers,
            "processes": [self.cold.pid, self.warm.pid],
            "elapsed_s": round(self.elapsed_s, 2),
        }


def store_config(opts: DemoOptions, directory: str) -> KVTierConfig:
    """cpu tier in every process, over a shared disk directory or a kvtier-server.

    The connector raises ``cpu.slot_bytes`` to one chunk of the model (see kvtier_hf.fit_config)."""
    cpu = CpuTierConfig(capacity_bytes=256 * MiB)
    if opts.server:
        return KVTierConfig(chunk_tokens=opts.chunk_tokens, cpu=cpu,
                            grpc=GrpcTierConfig(enabled=True, nodes=(opts.server,)))
    disk = DiskTierConfig(enabled=True, path=str(Path(directory) / "disk"), capacity_bytes=2048 * MiB)
    return KVTierConfig(chunk_tokens=opts.chunk_tokens, cpu=cpu, disk=disk)


def run_phase(opts: DemoOptions, phase: str) -> PhaseResult:
    """Run one phase in this process against the store under ``opts.dir`` (must be set)."""
    if not opts.dir:
        raise ValueError("run_phase needs opts.dir (the directory the phases share)")
    t0 = time.perf_counter()
    import torch  # lazy: the engine is only needed here

    from kvtier_hf import KVTierHF
    from kvtier_hf.compat import ForwardKwargs, new_cache
    from kvtier_hf.random_llama import PRESETS, build_random_llama, random_prompt

    spec = PRESETS[opts.preset]
    log.info("[%s] building the random-weight Llama (%s preset, seed %d)", phase, opts.preset, spec.seed)
    model = build_random_llama(spec)
    prompt = (random_prompt(opts.prefix_tokens, spec.vocab_size, opts.seed + 1)
              + random_prompt(opts.question_tokens, spec.vocab_size, opts.seed + 2))
    # Warm-up: same in both phases, outside the timings; its own tokens, so that a prompt of
    # any length (even shorter than the warm-up) works.
    warm = random_prompt(33, spec.vocab_size, opts.seed + 3)
    with torch.inference_mode():
        kwargs, cache = ForwardKwargs.of(model), new_cache(model.config)
        model(**kwargs.build(torch.tensor([warm[:32]]), cache, 0))
        model(**kwargs.build(torch.tensor([warm[32:]]), cache, 32))
    hf = KVTierHF(model, store_config(opts, opts.dir), chunk_tokens=opts.chunk_tokens)
    try:
        tiers = [t.name for t in hf.prefix_cache.store.tiers]
        setup_s = time.perf_counter() - t0
        log.info("[%s] generating: prompt of %d tokens, %d new tokens (tiers: %s)", phase,
                 len(prompt), opts.new_tokens, " -> ".join(tiers))
        res = hf.generate(prompt, opts.new_tokens)
        pairs = (measure_pairs(hf, prompt, dict(res.hits_per_tier), RESTORE_PAIRS)
                 if res.restored_tokens else None)
        log.info("[%s] restored %d tokens (chunks per tier: %s), prefilled %d, TTFT %.3f s; "
                 "flushing the store", phase, res.restored_tokens, res.hits_per_tier or "none",
                 res.prefilled_tokens, res.ttft_s)
    finally:
        hf.close()  # flushes the write-behind queue: the disk tier holds every chunk after this
    n_params = sum(p.numel() for p in model.parameters())
    model_desc = (f"random-weight Llama, {n_params / 1e6:.1f}M params, {spec.num_layers} layers, "
                  f"{spec.num_kv_heads} KV heads x {spec.head_dim}, {spec.dtype}")
    return PhaseResult(phase, list(res.tokens), res.prompt_tokens, res.restored_tokens,
                       res.prefilled_tokens, res.saved_chunks, dict(res.hits_per_tier), res.ttft_s,
                       res.restore_s, res.prefill_s, res.decode_s, setup_s, model_desc, tiers,
                       res.restore_bytes, list(pairs.restore_gbps) if pairs else [],
                       list(pairs.read_gbps) if pairs else [])


def _run_phase_subprocess(opts: DemoOptions, phase: str, flags: Sequence[str] = ()) -> PhaseResult:
    """Run ``phase`` in a fresh interpreter; its progress goes to our stderr, its result is the
    last line of its stdout."""
    cmd = [sys.executable, "-m", "kvtier.cli", "demo", "--_phase", phase, *opts.argv(), *flags]
    log.info("[%s] starting a fresh process: %s", phase, " ".join(cmd[1:]))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=PHASE_TIMEOUT_S, check=False)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{phase} phase process exited with status {proc.returncode} "
                           f"(its errors are above); stdout: {proc.stdout[-2000:]!r}")
    return PhaseResult.from_json(lines[-1])


def run_demo(opts: DemoOptions, child_flags: Sequence[str] = ()) -> DemoReport:
    """Cold phase here, warm phase in a fresh process (``child_flags``: extra CLI flags for it,
    e.g. ``-q``), over a temporary directory that is removed afterwards unless ``opts.dir``
    names one (then it is kept, and reused next time)."""
    t0 = time.perf_counter()
    tmp = None if opts.dir else tempfile.mkdtemp(prefix="kvtier-demo-")
    run_opts = opts if opts.dir else DemoOptions(**{**asdict(opts), "dir": tmp})
    try:
        cold = run_phase(run_opts, "cold")
        warm = _run_phase_subprocess(run_opts, "warm", child_flags)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return DemoReport(cold, warm, run_opts, time.perf_counter() - t0)


def format_report(report: DemoReport) -> str:
    """The human-readable summary (what ``kvtier demo`` prints before its JSON line)."""
    c, w, o = report.cold, report.warm, report.options
    hits = ", ".join(f"{tier}: {n} chunks" for tier, n in w.hits_per_tier.items()) or "none"
    where = f"kvtier-server {o.server}" if o.server else f"disk dir {o.dir}"
    verdict = "yes" if report.outputs_identical else "NO: the outputs differ"
    lines = [
        f"kvtier demo: {c.model}",
        (f"prompt: {c.prompt_tokens} tokens = {o.prefix_tokens} shared prefix + {o.question_tokens} "
         f"question; chunks of {o.chunk_tokens} tokens; tiers {' -> '.join(w.tiers)} ({where})"),
        "",
        f"{'':24}{'cold (pid ' + str(c.pid) + ')':>22}{'warm (pid ' + str(w.pid) + ')':>22}",
        f"{'time to first token':24}{c.ttft_s:>20.3f} s{w.ttft_s:>20.3f} s",
        f"{'  of which restore':24}{c.restore_s:>20.3f} s{w.restore_s:>20.3f} s",
        (f"{'  restore rate':24}{'':>22}{report.restore_gbps:>18.2f} GB/s  "
         f"(the serving tier's own read: {report.tier_read_gbps:.2f} GB/s)"),
        (f"{'  restore / tier read':24}{'':>22}{report.pairs.ratio:>18.2f}     "
         f"(median of {len(report.pairs.ratios)} back-to-back pairs: "
         f"{', '.join(f'{r:.2f}' for r in report.pairs.ratios)})"),
        f"{'tokens prefilled':24}{c.prefilled_tokens:>22}{w.prefilled_tokens:>22}",
        f"{'tokens restored':24}{c.restored_tokens:>22}{w.restored_tokens:>22}",
        f"{'chunks saved':24}{c.saved_chunks:>22}{w.saved_chunks:>22}",
        "",
        f"prefill tokens saved:  {w.restored_tokens} of {w.prompt_tokens}",
        f"TTFT speedup:          {report.speedup:.1f}x ({c.ttft_s:.3f} s -> {w.ttft_s:.3f} s)",
        f"hits per tier (warm):  {hits}",
        f"outputs identical:     {verdict} ({len(w.tokens)} greedy tokens: {w.tokens[:8]}...)",
        f"elapsed:               {report.elapsed_s:.1f} s",
    ]
    if not w.restored_tokens:
        lines.append("note: the warm run reused nothing; with --server, check that the server's "
                     "--slot-bytes holds one chunk (lower --chunk-tokens otherwise)")
    return "\n".join(lines)

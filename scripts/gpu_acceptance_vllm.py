"""The vLLM part of scripts/gpu_acceptance.py: real engines (vLLM's CUDA build), default
cudagraph settings, async scheduling, with and without kvtier.

Each engine runs in its own process (``python scripts/gpu_acceptance_vllm.py ROLE SPEC.json``)
so its GPU memory is freed between them; the parent compares what they print.

    vllm_outputs_identical  greedy tokens of the kvtier engine (cold, then warm from kvtier after
                            ``reset_prefix_cache``) equal the plain engine's, for a batch that
                            mixes running decodes with fully cached k*chunk+1-token prompts, with
                            a KV budget small enough to force preemption
    warm_ttft_vs_cold       median TTFT of a 32k-token prompt restored from kvtier over computing
                            it (3 fresh prompts; target <= 0.4)
    save_throughput_ratio   output tokens/s of 32 non-repeating prompts with kvtier saving over
                            without kvtier (target >= 0.95)
Model: ``--model``, else a random-weight Llama with Llama-8B attention (32 heads, 8 KV heads x
128, hidden 4096) and 4 layers, bf16, max 40k positions (tests/vllm_model.py's builder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 256
TTFT_TOKENS = 32768


def _prompts(seed: int, n: int, length: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def engine(role: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Runs inside the child process: build one engine, run the workloads, return results."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16",
                              max_model_len=TTFT_TOKENS + 1024, enable_prefix_caching=True,
                              async_scheduling=True, gpu_memory_utilization=0.85,
                              num_gpu_blocks_override=spec["gpu_blocks"], seed=0)
    if role != "plain":
        extra = {"chunk_tokens": CHUNK, "cpu": {"capacity_bytes": "16GiB"},
                 "vllm": {"model_id": "gpu-acceptance", "save": True, "load": True}}
        kw["kv_transfer_config"] = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier_vllm",
                                    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                    "kv_connector_extra_config": extra}
    llm = LLM(**kw)
    vocab = spec["vocab"]

    def gen(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    res: dict[str, Any] = {}
    # Identity: decodes of 24 prompts (forcing preemption in the small KV budget) batched with
    # fully cached k*chunk+1 prompts.
    mixed = _prompts(1, 24, 1500, vocab) + [p[:k * CHUNK + 1] for k, p in
                                             zip((1, 2, 3, 4), _prompts(2, 4, 4 * CHUNK + 1, vocab))]
    res["cold"] = gen(mixed, 64)
    if role != "plain":
        llm.reset_prefix_cache()
        res["warm"] = gen(mixed, 64)
    # TTFT of a 32k-token prompt: cold (computed, saved) then warm (vLLM cache reset).
    if role != "plain":
        cold, warm = [], []
        for i in range(3):
            p = _prompts(100 + i, 1, TTFT_TOKENS, vocab)
            t0 = time.perf_counter()
            gen(p, 1)
            cold.append(time.perf_counter() - t0)
            time.sleep(2.0)  # let the saver drain before the warm run
            llm.reset_prefix_cache()
            t0 = time.perf_counter()
            gen(p, 1)
            warm.append(time.perf_counter() - t0)
        res["ttft_cold_s"], res["ttft_warm_s"] = cold, warm
    # Decode throughput, non-repeating prompts (nothing to load; kvtier saves everything).
    batch = _prompts(200, 32, 512, vocab)
    t0 = time.perf_counter()
    outs = gen(batch, 256)
    res["tokens_per_s"] = sum(len(o) for o in outs) / (time.perf_counter() - t0)
    return res


def _build_model(args: argparse.Namespace, work: Path) -> tuple[str, int]:
    if args.model:
        cfg = json.loads(Path(args.model, "config.json").read_text())
        return args.model, int(cfg["vocab_size"])
    sys.path.insert(0, str(ROOT))
    from kvtier_hf.random_llama import TinyLlamaSpec

    from tests.vllm_model import build_model

    spec = TinyLlamaSpec(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=4,
                         num_heads=32, num_kv_heads=8, max_positions=TTFT_TOKENS + 8192,
                         initializer_range=0.02, seed=9, dtype="bfloat16")
    return str(build_model(work / "model", spec)), spec.vocab_size


def run_vllm(args: argparse.Namespace, skipped: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        skipped["vllm"] = f"vLLM is not importable: {exc}"
        return out
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-gpu-acc-"))
    model, vocab = _build_model(args, work)
    spec = {"model": model, "vocab": vocab, "gpu_blocks": (TTFT_TOKENS + 2048) // 16}
    results = {}
    for role in ("plain", "kvtier"):
        path = work / f"{role}.json"
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'connectors'}")
        log = open(work / f"{role}.log", "w")
        rc = subprocess.run([sys.executable, __file__, role, str(work / "spec.json"), str(path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT, timeout=420).returncode
        if rc != 0:
            skipped["vllm"] = f"{role} engine failed (rc {rc}); see {work / (role + '.log')}"
            return out
        results[role] = json.loads(path.read_text())
    plain, kv = results["plain"], results["kvtier"]
    out["vllm_outputs_identical"] = kv["cold"] == plain["cold"] and kv["warm"] == plain["cold"]
    out["vllm_outputs_same_fraction"] = sum(a == b for a, b in zip(kv["warm"], plain["cold"])) / len(plain["cold"])
    out["ttft_cold_s"], out["ttft_warm_s"] = kv["ttft_cold_s"], kv["ttft_warm_s"]
    out["warm_ttft_vs_cold"] = round(statistics.median(kv["ttft_warm_s"]) / statistics.median(kv["ttft_cold_s"]), 3)
    out["save_throughput_ratio"] = round(kv["tokens_per_s"] / plain["tokens_per_s"], 3)
    return out


if __name__ == "__main__":
    role, spec_path, out_path = sys.argv[1:4]
    result = engine(role, json.loads(Path(spec_path).read_text()))
    Path(out_path).write_text(json.dumps(result))

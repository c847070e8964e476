"""A tiny Llama with seeded random weights, saved as a safetensors checkpoint for vLLM tests.

Why not ``load_format="dummy"``: vLLM's dummy initialisation gives a model whose output does
not depend on the prefix, so "same output with and without kvtier" would prove nothing. These
weights (std 0.1, fp32) make the last-token log-probabilities move by ~0.1-1 when one early
prompt token changes, far above the 1e-3 tolerance the engine tests use.

No tokenizer is written: engines are started with ``skip_tokenizer_init=True`` and prompts are
token ids. Building is deterministic (same seed -> same bytes) and cached per directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from kvtier_hf.random_llama import TinyLlamaSpec, build_random_llama

# The engine tests' model: big enough for 128-token blocks to matter, small enough to start fast.
# Larger than kvtier_hf's test default; the same builder, so the same seeded weights recipe.
VLLM_TEST_SPEC = TinyLlamaSpec(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2,
                               num_heads=4, num_kv_heads=2, max_positions=8192,
                               initializer_range=0.1)


def build_model(path: str | os.PathLike[str], spec: TinyLlamaSpec = VLLM_TEST_SPEC) -> Path:
    """Write config.json + model.safetensors under ``path`` (skipped when already built)."""
    out = Path(path)
    stamp = out / "kvtier_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    model = build_random_llama(spec)
    # vLLM wants special token ids; 0-2 are never drawn by random_tokens.
    for cfg in (model.config, model.generation_config):
        cfg.bos_token_id, cfg.eos_token_id = 1, 2
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec)))
    return out


def kv_bytes(tokens: int, spec: TinyLlamaSpec = VLLM_TEST_SPEC) -> int:
    """K and V bytes of ``tokens`` tokens of ``spec`` as the engines run it (fp32)."""
    return tokens * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 4


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    """``n`` token ids in [3, vocab) (0-2 are pad/bos/eos), reproducible from ``seed``."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]

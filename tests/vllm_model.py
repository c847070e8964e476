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
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class TinyLlama:
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192
    initializer_range: float = 0.1
    seed: int = 0


def build_model(path: str | os.PathLike[str], spec: TinyLlama = TinyLlama()) -> Path:
    """Write config.json + model.safetensors under ``path`` (skipped when already built)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    stamp = out / "kvtier_model.json"
    if stamp.exists() and json.loads(stamp.read_text()) == asdict(spec):
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(spec.seed)
    cfg = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, torch_dtype="float32",
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out, safe_serialization=True)
    stamp.write_text(json.dumps(asdict(spec)))
    return out


def random_tokens(n: int, seed: int, vocab: int = 512) -> list[int]:
    """``n`` token ids in [3, vocab) (0-2 are pad/bos/eos), reproducible from ``seed``."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]

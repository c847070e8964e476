"""A random-weight Llama built from a config: a real engine for tests and ``kvtier demo``
without any download.

Determinism: weights come from ``torch.manual_seed(seed)`` followed by the model's own init,
so two processes with the same torch / transformers build produce the same weights. Because
a cached K/V chunk is only valid for the exact weights that produced it, the model id carries
the spec and the revision carries a fingerprint (xxh3-64) of the weights themselves: if two
builds ever disagree, their chunks land in different namespaces (a miss, never wrong bytes).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass

import torch
import xxhash
from transformers import LlamaConfig, LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TinyLlamaSpec:
    """Sizes of a random Llama; ``head_dim = hidden_size // num_heads``."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_positions: int = 4096
    seed: int = 0
    dtype: str = "float32"
    # Larger than Llama's 0.02 so that random logits are peaked: greedy ties are then far
    # rarer than float rounding differences, and equality tests compare real decisions.
    initializer_range: float = 0.08

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def model_id(self) -> str:
        digest = hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:12]
        return f"kvtier-testing/random-llama-{digest}"


# Sizes used by the test suite (fast) and by ``kvtier demo`` (a prefill long enough to measure:
# ~32M parameters, a few seconds for a 3K-token prefix on two CPU cores).
TEST_SPEC = TinyLlamaSpec()
DEMO_SPEC = TinyLlamaSpec(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8,
                          num_heads=8, num_kv_heads=4, max_positions=8192)
PRESETS: dict[str, TinyLlamaSpec] = {"test": TEST_SPEC, "demo": DEMO_SPEC}


def build_random_llama(spec: TinyLlamaSpec = TEST_SPEC) -> LlamaForCausalLM:
    """Build the model of ``spec`` in eval mode; ``config.name_or_path`` is ``spec.model_id``
    and ``model.kvtier_revision`` the weight fingerprint (see :func:`weights_fingerprint`)."""
    config = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    config._name_or_path = spec.model_id
    dtype = getattr(torch, spec.dtype)
    # The seed is set right before construction: the model's init consumes the default
    # generator in a fixed order, which is what makes the weights reproducible.
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.requires_grad_(False)
    model.kvtier_revision = weights_fingerprint(model)  # type: ignore[assignment]
    log.debug("built %s (%.1fM params, weights %s)", spec.model_id,
              sum(p.numel() for p in model.parameters()) / 1e6, model.kvtier_revision)
    return model


def weights_fingerprint(model: torch.nn.Module) -> str:
    """xxh3-64 over every parameter's bytes in name order (~0.1 s for 32M float32 params)."""
    h = xxhash.xxh3_64()
    for name, param in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(param.detach().contiguous().view(torch.uint8).numpy())
    return "w" + h.hexdigest()


def random_prompt(n: int, vocab_size: int, seed: int) -> list[int]:
    """``n`` token ids drawn from a private generator (never the global one)."""
    gen = torch.Generator().manual_seed(seed)
    return [int(t) for t in torch.randint(0, vocab_size, (n,), generator=gen)]

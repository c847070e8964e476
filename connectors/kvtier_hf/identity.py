"""Which weights and which config a transformers model's K/V come from: its namespace revision.

A chunk is valid only for the exact weights and K/V-relevant config that produced it, and the
namespace (kvtier.keys) is all that keeps another model's chunks out. Model id + hub commit
hash is enough for a hub model loaded as published (transformers 5 no longer records
``_commit_hash``; a model loaded from a hub cache snapshot directory is named by that
snapshot's commit, :func:`kvtier.checkpoint.model_revision`, but a hub id alone does not say
which revision was loaded, so pass ``revision=``); two cases are not covered by it and served
another model's K/V before this module (both reproduced: different greedy tokens, no error):

- no revision at all: a model loaded from a local directory has no commit hash, so a checkpoint
  saved again into the same directory kept its predecessor's namespace. The revision is then
  :func:`kvtier.checkpoint.checkpoint_revision` of the directory (from the files, so vLLM
  loading the same directory computes the same one), or, for a model that names no directory,
  :func:`weights_fingerprint` of its tensors in memory.
- config overridden at load (``from_pretrained(..., rope_parameters=...)``): same files, other
  K/V. :func:`config_overrides` finds the fields that differ from the checkpoint's own saved
  config and the revision gains ``+cfg=<hash>`` of them; loads as saved gain nothing (so
  engines that share chunks by naming the same revision keep sharing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

import torch
import xxhash

from kvtier.checkpoint import WINDOW, model_revision, window_starts

log = logging.getLogger(__name__)

# Config fields that change how a model is run or named, never the K/V it computes (the KV
# dtype is a namespace field of its own). Anything else that differs is an override.
RUNTIME_FIELDS = frozenset({
    "_name_or_path", "name_or_path", "_commit_hash", "transformers_version", "dtype", "torch_dtype",
    "attn_implementation", "_attn_implementation", "_attn_implementation_autoset",
    "_attn_implementation_internal", "_experts_implementation", "use_cache", "output_attentions",
    "output_hidden_states", "return_dict", "torchscript", "use_return_dict", "tie_word_embeddings",
    "architectures", "auto_map", "pad_token_id", "bos_token_id", "eos_token_id", "id2label",
    "label2id", "problem_type", "tokenizer_class", "task_specific_params",
})
_WINDOWS = 4  # windows (kvtier.checkpoint.WINDOW bytes) per tensor, spread over it


def derived_revision(model: Any) -> str:
    """The revision of ``model`` when neither the caller nor the model names one (see the
    module docstring); logs which it used. Raises OSError when the checkpoint's weight files
    cannot be read."""
    path = str(getattr(model.config, "name_or_path", "") or "")
    # A directory only: for a hub id the cache's main snapshot need not be the revision that
    # was loaded (transformers 5 no longer records it), so a hub model without revision= is
    # named by its weights in memory.
    rev = model_revision(path) if path and os.path.isdir(path) else ""
    if rev:
        log.info("model %s names no revision: using %s (its hub snapshot's commit, or a fingerprint "
                 "of its files); pass revision= to name it", path, rev)
        return rev
    rev = weights_fingerprint(model)
    log.info("model %s names no revision and no checkpoint directory: using a fingerprint of its "
             "weights in memory (%s)", path or "(unnamed)", rev)
    return rev


def weights_fingerprint(model: torch.nn.Module) -> str:
    """``"mem-<xxh3-128>"`` over every tensor's name, dtype, shape and :data:`_WINDOWS` windows
    of its bytes (one small gather per tensor, on its own device: cheap for a GPU model too)."""
    h = xxhash.xxh3_128()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        n = flat.numel()
        idx = torch.cat([torch.arange(s, min(n, s + WINDOW))
                         for s in window_starts(n, _WINDOWS)]).to(flat.device)
        h.update(flat.index_select(0, idx).cpu().numpy().tobytes())
    return "mem-" + h.hexdigest()


def config_overrides(config: Any) -> dict[str, Any]:
    """The fields of ``config`` that differ from the config saved with its checkpoint (runtime
    fields aside); empty when they agree or when no saved config can be read locally (a model
    built in code, a hub model not in the local cache: nothing to compare with)."""
    path = str(getattr(config, "name_or_path", "") or "")
    if not path:
        return {}
    try:
        saved = type(config).from_pretrained(path, revision=getattr(config, "_commit_hash", None),
                                             local_files_only=True)
    except (OSError, ValueError) as exc:
        log.debug("no saved config to compare %s with: %s", path, exc)
        return {}
    return _differences(config.to_dict(), saved.to_dict())


def overrides_suffix(config: Any) -> str:
    """``"+cfg=<sha256 prefix>"`` of :func:`config_overrides`, or "" when there are none."""
    diff = config_overrides(config)
    if not diff:
        return ""
    digest = hashlib.sha256(json.dumps(diff, sort_keys=True, default=str).encode()).hexdigest()[:16]
    log.info("model %s overrides its saved config in %s: its K/V get a namespace of their own",
             getattr(config, "name_or_path", ""), sorted(diff))
    return f"+cfg={digest}"


def _differences(mine: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(set(mine) | set(saved), key=str):
        if key in RUNTIME_FIELDS:
            continue
        a, b = mine.get(key), saved.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            sub = _differences(a, b)
            if sub:
                out[key] = sub
        elif a != b:
            out[key] = a
    return out

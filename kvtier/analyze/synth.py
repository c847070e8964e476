"""Synthetic request logs with planted cache breakers, and a tiny local tokenizer.

For the tests, the speed bench and trying ``kvtier analyze`` without a log of one's own. Every
generator is seeded and deterministic. A planted breaker is one of :data:`KINDS`; ``clean``
plants none (a shared system prompt and tools, then a per-request question).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

KINDS = ("timestamp", "tool_order", "json", "preamble")
#: The classification each planted kind must get (see kvtier.analyze.classify).
EXPECTED = {"timestamp": "timestamp", "tool_order": "reordered_items",
            "json": "json_reserialized", "preamble": "per_user_preamble"}
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu "
          "cache prefix token model request answer policy review summary context customer order "
          "invoice refund account billing shipping product search report chart table").split()
_NAMES = ["Alice", "Bob", "Carol", "Dmitri", "Emeka", "Fatima", "Gustavo", "Hiro", "Ingrid",
          "Jamal", "Keiko", "Lars", "Mei", "Nadia", "Omar", "Priya"]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    names = ["search_orders", "issue_refund", "lookup_customer", "send_email", "create_ticket"]
    return [{"name": n, "description": _words(rng, 25),
             "parameters": {"type": "object", "properties": {
                 "id": {"type": "string", "description": _words(rng, 8)},
                 "limit": {"type": "integer", "description": _words(rng, 6)}}}}
            for n in names]


def prompts(kind: str, n: int, seed: int = 0) -> Iterator[tuple[float, str, str]]:
    """(unix time, tenant, prompt) of ``n`` requests with a ``kind`` breaker (or ``clean``)."""
    if kind not in (*KINDS, "clean"):
        raise ValueError(f"unknown kind {kind!r}; expected one of {(*KINDS, 'clean')}")
    rng = random.Random(f"{kind}/{seed}")
    system = f"You are the {kind} support assistant. " + _words(rng, 300) + "\n"
    tools = _tools(rng)
    t0 = datetime(2026, 12, 1, 9, 0, 0, tzinfo=timezone.utc)
    for i in range(n):
        t = t0 + timedelta(seconds=7 * i + rng.randint(0, 6))
        user = rng.choice(_NAMES)
        question = f"\nUser: {_words(rng, 40)}\n"
        head = f"You are the {kind} support assistant.\n"
        tl = list(tools)
        cfg = {"locale": "en-GB", "temperature": 0.25, "max_items": 20,
               "features": {"refunds": True, "emails": False}}
        cfg_text = json.dumps(cfg, sort_keys=True)
        if kind == "timestamp":
            head += f"Current time: {t.strftime('%Y-%m-%dT%H:%M:%SZ')}.\n"
        elif kind == "tool_order":
            rng.shuffle(tl)
        elif kind == "json":
            keys = list(cfg)
            rng.shuffle(keys)
            sep = rng.choice([(",", ":"), (", ", ": ")])
            cfg_text = json.dumps({k: cfg[k] for k in keys}, separators=sep)
        elif kind == "preamble":
            head = f"Customer: {user}, plan {rng.choice(['gold', 'silver', 'basic'])}.\n" + head
        text = (head + "Settings: " + cfg_text + "\nTools:\n" + json.dumps(tl) + "\n" +
                system + question)
        yield t.timestamp(), user, text


def write_text_log(path: Path, kind: str, n: int, seed: int = 0) -> Path:
    """A JSONL text log (``prompt``, ``timestamp``, ``tenant``, ``model``, ``output_length``)."""
    with path.open("w") as f:
        for ts, tenant, text in prompts(kind, n, seed):
            f.write(json.dumps({"timestamp": ts, "tenant": tenant, "model": "demo-model",
                                "prompt": text, "output_length": 50}) + "\n")
    return path


def write_mooncake_log(path: Path, n: int, seed: int = 0) -> Path:
    """A Mooncake-format trace of ``n`` requests: a few shared system prompts, multi-turn
    sessions that re-send their history, one-off prompts; ~4 blocks of 512 tokens each."""
    rng = random.Random(f"mooncake/{seed}")
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        next_id += k
        return list(range(next_id - k, next_id))

    systems = [fresh(rng.randint(1, 3)) for _ in range(20)]
    sessions: list[list[int]] = []
    with path.open("w") as f:
        for i in range(n):
            roll = rng.random()
            if sessions and roll < 0.45:
                s = rng.randrange(len(sessions))
                sessions[s] = ids = sessions[s] + fresh(1)
                if len(ids) > 12:
                    sessions.pop(s)
            elif roll < 0.85:
                ids = rng.choice(systems) + fresh(rng.randint(1, 2))
                sessions.append(ids)
                if len(sessions) > 2000:
                    sessions.pop(0)
            else:
                ids = fresh(rng.randint(1, 4))
            f.write(json.dumps({"timestamp": i * 20, "input_length": 512 * len(ids) - rng.randint(0, 511),
                                "output_length": 100, "hash_ids": ids}) + "\n")
    return path


def build_tokenizer(directory: Path, corpus: list[str] | None = None) -> Path:
    """Train a small byte-level BPE on ``corpus`` (default: the planted logs' text) and save
    it where ``AutoTokenizer.from_pretrained(directory, local_files_only=True)`` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if corpus is None:
        corpus = [p for k in (*KINDS, "clean") for _, _, p in prompts(k, 20, seed=99)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(directory))
    return directory

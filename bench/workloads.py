"""Seeded generator of request traces in the Mooncake JSONL format, for judging eviction policies.

    python bench/workloads.py --workload NAME --seed N [--scale X] --out PATH.jsonl

Each request is one JSON line ``{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [...]}`` where ``hash_ids`` lists the prompt's 512-token blocks, prefix-
chained like the shared trace (``../shared/traces/README.md``): a block id recurs only where the
whole prefix up to it recurs, and ids are numbered in order of first appearance.

Request classes (each a function below; its docstring gives its parameters): ``chat``
(multi-turn conversations), ``agent`` (tool loops), ``rag`` (shared system prompts with popular
and long-tail documents), one-shot ``scan`` bursts (no reuse at all) and ``rounds`` (passes
over a fixed corpus, the cyclic reuse ARC-like policies thrash on). Named workloads
(:data:`WORKLOADS`) are a class on its own, a chat background interrupted by scans
(``scan``), or all four side by side (``mix``); ``rrchat`` (chat served round-robin) and
``docqa`` (questions over a document corpus) are shapes the default policy once lost on. The
generator knows nothing about any policy and was written from these descriptions, not fitted
to any trace.

Pure and deterministic: the same name, seed and scale give the same trace in every process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

BLOCK_TOKENS = 512
MINUTE_MS = 60_000


@dataclass(frozen=True)
class Request:
    """One request: arrival time, the prompt as block *contents* (chained into ids later) and
    the answer's length in blocks."""

    timestamp_ms: int
    contents: tuple[Hashable, ...]
    output_blocks: int


def _pareto_ms(rng: random.Random, scale_ms: float, alpha: float, cap_ms: float) -> float:
    """Heavy-tailed delay: Pareto with minimum ``scale_ms`` and tail index ``alpha``, capped."""
    return min(cap_ms, scale_ms * rng.paretovariate(alpha))


def _arrivals(rng: random.Random, duration_ms: float, per_min: float) -> Iterator[tuple[float, int]]:
    """A Poisson process of ``per_min`` arrivals a minute over ``duration_ms``: (time, n) with
    n = 1, 2, ...; the gap is drawn before the caller's draws for that arrival."""
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(per_min / MINUTE_MS)
        if t >= duration_ms:
            return
        n += 1
        yield t, n


def _zipf_picker(rng: random.Random, n: int, alpha: float) -> Callable[[], int]:
    """Draws 0..n-1 with P(i) proportional to 1 / (i + 1) ** alpha."""
    weights = [1.0 / (i + 1) ** alpha for i in range(n)]
    cum: list[float] = []
    total = 0.0
    for w in weights:
        total += w
        cum.append(total)
    population = range(n)
    return lambda: rng.choices(population, cum_weights=cum)[0]


def chat(rng: random.Random, duration_ms: float, tag: str = "chat",
         sessions_per_min: float = 18.0, system_prompts: int = 4, system_blocks: int = 2,
         mean_turns: float = 8.0, think_ms: float = 20_000.0, think_alpha: float = 1.3,
         think_cap_ms: float = 20 * MINUTE_MS) -> list[Request]:
    """Multi-turn chat: many concurrent users, each turn extends the previous prompt + answer.

    - Sessions arrive as a Poisson process (``sessions_per_min``); each picks one of
      ``system_prompts`` shared system prompts (``system_blocks`` blocks, Zipf-popular).
    - The first user message is 1-4 blocks, or 4-16 blocks (a pasted document) one time in five.
    - A session has a geometric number of turns (mean ``mean_turns``). Turn n+1's prompt is turn
      n's prompt, then its answer (0-2 blocks), then the new user message (1-3 blocks).
    - Think time between turns is Pareto (minimum ``think_ms``, tail index ``think_alpha``,
      capped at ``think_cap_ms``): most users answer within seconds, a few after many minutes,
      so reuse gaps range from a few requests to many cache sizes.
    """
    pick_system = _zipf_picker(rng, system_prompts, 1.0)
    out: list[Request] = []
    for t, sid in _arrivals(rng, duration_ms, sessions_per_min):
        sys_id = pick_system()
        prompt: list[Hashable] = [(tag, "sys", sys_id, j) for j in range(system_blocks)]
        first = rng.randint(4, 16) if rng.random() < 0.2 else rng.randint(1, 4)
        prompt += [(tag, sid, 0, j) for j in range(first)]
        now, turn = t, 0
        while now < duration_ms:
            answer = rng.randint(0, 2)
            out.append(Request(int(now), tuple(prompt), answer))
            if rng.random() < 1.0 / mean_turns:
                break
            turn += 1
            prompt += [(tag, sid, turn, "a", j) for j in range(answer)]
            prompt += [(tag, sid, turn, "u", j) for j in range(rng.randint(1, 3))]
            now += _pareto_ms(rng, think_ms, think_alpha, think_cap_ms)
    return out


def agent(rng: random.Random, duration_ms: float, tag: str = "agent",
          tasks_per_min: float = 8.0, agent_kinds: int = 6, prefix_blocks: tuple[int, int] = (8, 24),
          mean_steps: float = 15.0, step_ms: float = 4_000.0) -> list[Request]:
    """Agent loops: a long shared tool/system prefix plus a scratchpad that grows every step.

    - ``agent_kinds`` agent types, Zipf-popular, each with its own tool/system prefix of
      ``prefix_blocks`` (min, max) blocks shared by all its tasks.
    - Tasks arrive as a Poisson process (``tasks_per_min``); a task adds a 1-3 block description.
    - A task runs a geometric number of steps (mean ``mean_steps``); each step appends 1 block
      (2 one time in four: a long tool result) and the next step follows after an exponential
      delay of mean ``step_ms`` (fast turns, no human in the loop).
    """
    pick_kind = _zipf_picker(rng, agent_kinds, 1.0)
    prefix_len = [rng.randint(*prefix_blocks) for _ in range(agent_kinds)]
    out: list[Request] = []
    for t, task in _arrivals(rng, duration_ms, tasks_per_min):
        kind = pick_kind()
        prompt: list[Hashable] = [(tag, "tools", kind, j) for j in range(prefix_len[kind])]
        prompt += [(tag, task, "task", j) for j in range(rng.randint(1, 3))]
        now, step = t, 0
        while now < duration_ms:
            out.append(Request(int(now), tuple(prompt), 1))
            if rng.random() < 1.0 / mean_steps:
                break
            step += 1
            prompt += [(tag, task, step, j) for j in range(2 if rng.random() < 0.25 else 1)]
            now += rng.expovariate(1.0 / step_ms)
    return out


def rag(rng: random.Random, duration_ms: float, tag: str = "rag",
        requests_per_min: float = 150.0, system_prompts: int = 3, system_blocks: int = 3,
        documents: int = 3000, doc_blocks: tuple[int, int] = (1, 6), doc_alpha: float = 0.9,
        docs_per_request: tuple[int, int] = (1, 3)) -> list[Request]:
    """Retrieval-augmented generation: shared system prompt, retrieved documents, a question.

    - Requests arrive as a Poisson process (``requests_per_min``), each with one of
      ``system_prompts`` shared system prompts (``system_blocks`` blocks, uniform).
    - ``docs_per_request`` (min, max) documents follow, drawn from a corpus of ``documents``
      with Zipf popularity ``doc_alpha`` (a few popular documents, a long tail), each
      ``doc_blocks`` (min, max) blocks long. Prefix chaining means a document's blocks are
      reused only behind the same system prompt and earlier documents, as in a real prefix cache.
    - A 1-block question, unique to the request, ends the prompt.
    """
    pick_doc = _zipf_picker(rng, documents, doc_alpha)
    doc_len = [rng.randint(*doc_blocks) for _ in range(documents)]
    out: list[Request] = []
    for t, n in _arrivals(rng, duration_ms, requests_per_min):
        sys_id = rng.randrange(system_prompts)
        prompt: list[Hashable] = [(tag, "sys", sys_id, j) for j in range(system_blocks)]
        for _ in range(rng.randint(*docs_per_request)):
            d = pick_doc()
            prompt += [(tag, "doc", d, j) for j in range(doc_len[d])]
        prompt.append((tag, "q", n))
        out.append(Request(int(t), tuple(prompt), 1))
    return out


def scan(rng: random.Random, start_ms: float, blocks: int, tag: str = "scan",
         request_blocks: tuple[int, int] = (8, 64), gap_ms: float = 50.0) -> list[Request]:
    """One-shot scan: a batch job of ``blocks`` blocks in all, never reused.

    Back-to-back requests (every ``gap_ms``) from ``start_ms`` on, each ``request_blocks``
    (min, max) blocks of content no other request shares: every block is seen exactly once.
    """
    out: list[Request] = []
    t, n, left = start_ms, 0, blocks
    while left > 0:
        size = min(left, rng.randint(*request_blocks))
        out.append(Request(int(t), tuple((tag, n, j) for j in range(size)), 1))
        left -= size
        n += 1
        t += gap_ms
    return out


def rounds(rng: random.Random, duration_ms: float, tag: str = "rounds", prompts: int = 600,
           system_blocks: int = 4, prompt_blocks: tuple[int, int] = (4, 12),
           requests_per_min: float = 200.0, swaps: float = 0.1) -> list[Request]:
    """Passes over a fixed corpus: an evaluation harness or a batch job run again and again,
    or sessions served round-robin. Every pass sends each of ``prompts`` prompts once (a shared
    system prompt of ``system_blocks`` blocks, then ``prompt_blocks`` (min, max) blocks of its
    own) at ``requests_per_min``, in the previous pass's order with ``swaps`` x ``prompts``
    random pairs exchanged. Its reuse distance is one pass for every block but the system
    prompt's: a cache that holds most of a pass, not all, is where policies differ most."""
    sizes = [rng.randint(*prompt_blocks) for _ in range(prompts)]
    order = list(range(prompts))
    out: list[Request] = []
    step = MINUTE_MS / requests_per_min
    t = 0.0
    while t < duration_ms:
        for i in order:
            if t >= duration_ms:
                break
            contents = [(tag, "sys", j) for j in range(system_blocks)] + [(tag, i, j) for j in range(sizes[i])]
            out.append(Request(int(t), tuple(contents), 1))
            t += step
        for _ in range(int(swaps * prompts)):
            a, b = rng.randrange(prompts), rng.randrange(prompts)
            order[a], order[b] = order[b], order[a]
    return out


def round_robin_chat(rng: random.Random, duration_ms: float, tag: str = "rrchat",
                     sessions: int = 400, live: int = 150, requests_per_min: float = 300.0,
                     system_prompts: int = 4, system_blocks: int = 2,
                     mean_turns: float = 12.0) -> list[Request]:
    """Chat served round-robin: ``live`` conversations at a time, each sending its next turn
    once per round (a batch scheduler cycling over its open sessions), at ``requests_per_min``.
    A conversation ends after a geometric number of turns (mean ``mean_turns``) and a new one
    takes its place until ``sessions`` have started. Turns grow as in :func:`chat` (a system
    prompt among ``system_prompts``, Zipf-popular; answer 0-2 blocks, user message 1-3). Every
    live prompt comes back after one round: reuse one round apart, like ``rounds``, but each
    return is one turn longer and the set of prompts drifts as conversations end."""
    pick_system = _zipf_picker(rng, system_prompts, 1.0)
    step = MINUTE_MS / requests_per_min
    started = 0

    def start() -> tuple[list[Hashable], int, int]:
        nonlocal started
        started += 1
        first = rng.randint(4, 16) if rng.random() < 0.2 else rng.randint(1, 4)
        return ([(tag, "sys", pick_system(), j) for j in range(system_blocks)]
                + [(tag, started, 0, j) for j in range(first)], started, 0)

    # One slot per live conversation: (its prompt so far, its id, its turn); a finished one
    # hands its slot to a new conversation, or leaves it empty once ``sessions`` have started.
    slots = [start() for _ in range(min(live, sessions))]
    out: list[Request] = []
    t = 0.0
    while slots and t < duration_ms:
        nxt: list[tuple[list[Hashable], int, int]] = []
        for prompt, sid, turn in slots:
            if t >= duration_ms:
                break
            answer = rng.randint(0, 2)
            out.append(Request(int(t), tuple(prompt), answer))
            t += step
            if rng.random() < 1.0 / mean_turns:
                if started < sessions:
                    nxt.append(start())
                continue
            prompt += [(tag, sid, turn + 1, "a", j) for j in range(answer)]
            prompt += [(tag, sid, turn + 1, "u", j) for j in range(rng.randint(1, 3))]
            nxt.append((prompt, sid, turn + 1))
        slots = nxt
    return out


def docs_qa(rng: random.Random, duration_ms: float, tag: str = "docqa",
            requests_per_min: float = 150.0, documents: int = 800,
            doc_blocks: tuple[int, int] = (2, 16), doc_alpha: float = 0.8,
            system_blocks: int = 2) -> list[Request]:
    """Questions over a document corpus: one shared system prompt (``system_blocks``), then
    one document of ``doc_blocks`` (min, max) blocks drawn from ``documents`` with a Zipf
    popularity ``doc_alpha`` that does not drift, then a unique 1-2 block question; Poisson
    arrivals at ``requests_per_min``. Each document is asked many questions, the popular ones
    far more often: how often, not how recently, predicts the next read (LFU's workload)."""
    pick_doc = _zipf_picker(rng, documents, doc_alpha)
    doc_len = [rng.randint(*doc_blocks) for _ in range(documents)]
    out: list[Request] = []
    for t, n in _arrivals(rng, duration_ms, requests_per_min):
        d = pick_doc()
        prompt: list[Hashable] = [(tag, "sys", j) for j in range(system_blocks)]
        prompt += [(tag, "doc", d, j) for j in range(doc_len[d])]
        prompt += [(tag, "q", n, j) for j in range(rng.randint(1, 2))]
        out.append(Request(int(t), tuple(prompt), 1))
    return out


def _distinct(reqs: Sequence[Request]) -> int:
    return len({c for r in reqs for c in r.contents})


def _chat_with_scans(rng: random.Random, duration_ms: float) -> list[Request]:
    """Chat, with two scan bursts (at 1/3 and 2/3 of the run) of 20% of chat's distinct blocks."""
    reqs = chat(rng, duration_ms)
    size = _distinct(reqs) // 5
    return reqs + scan(rng, duration_ms / 3, size, "scan1") + scan(rng, 2 * duration_ms / 3, size, "scan2")


def _mix(rng: random.Random, duration_ms: float) -> list[Request]:
    """All four classes side by side: chat and RAG at their default rates, agents at a quarter
    of theirs (a long agent prompt is re-sent every few seconds, so at full rate agents would
    be most of the blocks), plus two scan bursts of 10% of their distinct blocks."""
    reqs = chat(rng, duration_ms) + agent(rng, duration_ms, tasks_per_min=2.0) + rag(rng, duration_ms)
    size = _distinct(reqs) // 10
    return reqs + scan(rng, duration_ms / 3, size, "scan1") + scan(rng, 2 * duration_ms / 3, size, "scan2")


#: Named workloads: name -> (rng, duration in ms) -> requests, in any order.
WORKLOADS: dict[str, Callable[[random.Random, float], list[Request]]] = {
    "chat": lambda rng, d: chat(rng, d),
    "agent": lambda rng, d: agent(rng, d),
    "rag": lambda rng, d: rag(rng, d),
    "scan": _chat_with_scans,
    "mix": _mix,
    "rounds": lambda rng, d: rounds(rng, d),
    "rrchat": lambda rng, d: round_robin_chat(rng, d),
    "docqa": lambda rng, d: docs_qa(rng, d),
}
#: Simulated minutes of a workload at ``scale=1`` (about 3-5k requests, 40-120k blocks).
BASE_MINUTES = 30.0


def generate(name: str, seed: int, scale: float = 1.0) -> list[list[int]]:
    """The named workload's requests in arrival order, as lists of prefix-chained block ids."""
    return [ids for _, ids, _ in generate_records(name, seed, scale)]


def generate_records(name: str, seed: int, scale: float = 1.0) -> list[tuple[int, list[int], int]]:
    """(timestamp ms, block ids, output blocks) per request, in arrival order."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; expected one of {sorted(WORKLOADS)}")
    if scale <= 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    rng = random.Random(f"{name}:{seed}")
    reqs = WORKLOADS[name](rng, BASE_MINUTES * MINUTE_MS * scale)
    # Stable sort by time: equal timestamps keep generation order, so the trace is reproducible.
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].timestamp_ms)
    chain: dict[tuple[int, Hashable], int] = {}  # (parent id, content) -> id: prefix chaining
    out = []
    for i in order:
        r = reqs[i]
        parent = -1
        ids = []
        for c in r.contents:
            parent = chain.setdefault((parent, c), len(chain))
            ids.append(parent)
        out.append((r.timestamp_ms, ids, r.output_blocks))
    return out


def to_jsonl(records: Sequence[tuple[int, list[int], int]]) -> str:
    return "".join(json.dumps({"timestamp": t, "input_length": len(ids) * BLOCK_TOKENS,
                               "output_length": out * BLOCK_TOKENS, "hash_ids": ids}) + "\n"
                   for t, ids, out in records)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--scale", type=float, default=1.0, help="simulated time, x 30 minutes")
    ap.add_argument("--out", type=Path, help="default: stdout")
    args = ap.parse_args(argv)
    text = to_jsonl(generate_records(args.workload, args.seed, args.scale))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A vLLM replica in its own process, driven line by line over stdin/stdout (JSON).

Used by tests/test_vllm_engine.py and bench/e2e_vllm.py: each replica is a real ``vllm.LLM``
(EngineCore + worker processes) with its own options, so two replicas sharing a kvtier store are
two independent engines. Protocol: one JSON command per line in, one JSON reply per line out
(after a ``READY`` line). Commands:

    {"op": "generate", "prompts": [{"tokens": [...], "cache_salt": "t1"?}], "max_tokens": 8}
    {"op": "reset_prefix_cache"}          {"op": "exit"}
    {"op": "dump_kv", "path": "/tmp/kv.pt"}   (options "kv_dump": true: every worker's paged KV
                                           tensors, torch.save'd as a list in layer order)

``generate`` replies ``{"outputs": [{"token_ids", "logprobs", "num_cached_tokens",
"kvtier", "ttft_s"}]}``; ``logprobs[i]`` is the log-probability of ``token_ids[i]``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "connectors")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["VLLM_LOGGING_STREAM"] = "ext://sys.stderr"  # stdout carries the replies
    # vLLM reserves one more core for the scheduler whenever a KV connector is configured
    # (utils/ompmultiprocessing.py:53); on a 2-core host that leaves none, so the worker's
    # OpenMP team spans both cores and fights the scheduler process. Reserve one core for
    # every engine, with or without kvtier, so they compute on the same core.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    env.setdefault("TQDM_DISABLE", "1")
    return env


class Replica:
    """Parent-side handle. ``options``: model (path), kvtier (extra config dict or None),
    prefix_caching (bool), max_model_len (int), seed (int), kv_cache_bytes (int: KV cache size),
    load_failure_policy (str), kv_transfer (a whole KVTransferConfig dict, instead of kvtier),
    faulty_tier (FaultyTier keyword arguments: the store is one such tier; faulty_site/),
    kv_events_endpoint (str: publish vLLM's KV events there over ZMQ),
    connector_module (the module vLLM loads ``KVTierConnector`` from; default kvtier_vllm),
    env (extra environment variables of the engine processes)."""

    def __init__(self, options: dict[str, Any], log_path: str | os.PathLike[str], timeout_s: float = 240) -> None:
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in close()
        env = engine_env()
        env.update(options.get("env") or {})
        if options.get("kv_cache_bytes"):
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
        if options.get("faulty_tier") is not None:  # kvtier's store: one tests.fakes.FaultyTier
            env["KVTIER_TEST_FAULTY_TIER"] = json.dumps(options["faulty_tier"])
            env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "faulty_site"), env["PYTHONPATH"]])
        self.proc = subprocess.Popen(
            [sys.executable, __file__, json.dumps(options)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=str(ROOT))
        self._expect_ready(timeout_s)

    def _readline(self, timeout_s: float) -> str:
        import select

        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"replica gave no answer in {timeout_s:.0f}s (log: {self.log.name})")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline().decode()
                if not line:
                    raise RuntimeError(f"replica exited with {self.proc.wait()} (log: {self.log.name})")
                if line.startswith("@@"):
                    return line[2:]
            elif self.proc.poll() is not None:
                raise RuntimeError(f"replica exited with {self.proc.returncode} (log: {self.log.name})")

    def _expect_ready(self, timeout_s: float) -> None:
        line = self._readline(timeout_s)
        if line.strip() != "READY":
            raise RuntimeError(f"replica did not start: {line!r} (log: {self.log.name})")

    def call(self, cmd: dict[str, Any], timeout_s: float = 240) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        reply = json.loads(self._readline(timeout_s))
        if "error" in reply:
            raise RuntimeError(f"replica error: {reply['error']}")
        return reply

    def generate(self, prompts: list[dict[str, Any]], max_tokens: int = 8) -> list[dict[str, Any]]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens})["outputs"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout_s=60)
            except (RuntimeError, TimeoutError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()



def generate_one(rep: Replica, tokens: list[int], timeout_s: float, max_tokens: int = 8) -> dict[str, Any]:
    """One greedy generation of ``tokens`` (the reply's single output), answered within ``timeout_s``."""
    out: dict[str, Any] = rep.call({"op": "generate", "prompts": [{"tokens": tokens}], "max_tokens": max_tokens},
                                   timeout_s=timeout_s)["outputs"][0]
    return out


def assert_same_output(out: dict[str, Any], ref: dict[str, Any], tol: float) -> None:
    """Greedy tokens equal and log-probs within ``tol`` of the reference output."""
    assert out["token_ids"] == ref["token_ids"]
    diff = max(abs(a - b) for a, b in zip(out["logprobs"], ref["logprobs"]))
    assert diff <= tol, f"logprobs differ by {diff}"

# --- child side -----------------------------------------------------------------------------------
_REPLIES: Any = None  # a private copy of the original stdout; fd 1 itself goes to stderr


def _emit(obj: Any) -> None:
    _REPLIES.write("@@" + (obj if isinstance(obj, str) else json.dumps(obj)) + "\n")
    _REPLIES.flush()


def _make_llm(opts: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {
        "model": opts["model"], "skip_tokenizer_init": True, "dtype": "float32",
        "max_model_len": opts.get("max_model_len", 4096), "enforce_eager": True,
        "seed": opts.get("seed", 0), "enable_prefix_caching": opts.get("prefix_caching", True),
        "max_num_batched_tokens": opts.get("max_num_batched_tokens", 8192),
        "disable_log_stats": True}
    if opts.get("kv_cache_bytes"):
        kw["kv_cache_memory_bytes"] = opts["kv_cache_bytes"]  # a small KV cache forces preemption
    if opts.get("kv_dump"):
        kw["worker_extension_cls"] = "tests.vllm_replica.KVCacheDump"
    if opts.get("kv_events_endpoint"):  # vLLM's ZMQ KV events (tests/test_kv_events_vllm.py)
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=opts["kv_events_endpoint"])
    if opts.get("kv_transfer") is not None:  # a whole KVTransferConfig (e.g. a MultiConnector)
        kw["kv_transfer_config"] = KVTransferConfig(**opts["kv_transfer"])
    elif opts.get("kvtier") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVTierConnector", kv_role="kv_both",
            kv_connector_module_path=opts.get("connector_module", "kvtier_vllm"),
            kv_load_failure_policy=opts.get("load_failure_policy", "recompute"),
            kv_connector_extra_config=opts["kvtier"])
    return LLM(**kw)


class KVCacheDump:
    """Worker extension (vLLM's ``worker_extension_cls``): what the engine's own paged KV
    tensors hold, for tests that compare restored bytes with them, independently of kvtier."""

    model_runner: Any

    def kvtier_dump_kv_cache(self, path: str) -> list[list[int]]:
        import torch

        caches = [t.detach().cpu().clone() for t in self.model_runner.kv_caches]
        torch.save(caches, path)
        return [list(t.shape) for t in caches]


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=cmd.get("max_tokens", 8), temperature=0.0, logprobs=1,
                        detokenize=False, ignore_eos=True)
    prompts = []
    for p in cmd["prompts"]:
        item: dict[str, Any] = {"prompt_token_ids": p["tokens"]}
        if p.get("cache_salt"):
            item["cache_salt"] = p["cache_salt"]
        prompts.append(item)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    result = []
    for o in outs:
        c = o.outputs[0]
        lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
        ttft = None
        m = getattr(o, "metrics", None)
        if m is not None and getattr(m, "first_token_latency", None):
            ttft = m.first_token_latency
        params = getattr(o, "kv_transfer_params", None) or {}
        result.append({"token_ids": list(c.token_ids), "logprobs": lps, "finish_reason": c.finish_reason,
                       "num_cached_tokens": o.num_cached_tokens, "kvtier": params.get("kvtier"),
                       "ttft_s": ttft})
    return {"outputs": result, "wall_s": wall}


def main() -> None:
    global _REPLIES
    # Engine processes inherit fd 1: point it at stderr so nothing but replies reaches the pipe
    # (a chatty child must never fill the pipe while the parent is not reading).
    _REPLIES = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    opts = json.loads(sys.argv[1])
    llm = _make_llm(opts)
    _emit("READY")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "generate":
                _emit(_generate(llm, cmd))
            elif cmd["op"] == "dump_kv":
                _emit({"shapes": llm.collective_rpc("kvtier_dump_kv_cache", args=(cmd["path"],))})
            elif cmd["op"] == "reset_prefix_cache":
                _emit({"ok": bool(llm.reset_prefix_cache())})
            elif cmd["op"] == "exit":
                _emit({"ok": True})
                break
            else:
                _emit({"error": f"unknown op {cmd['op']!r}"})
        except Exception as exc:  # noqa: BLE001 - report any engine error to the parent test
            _emit({"error": f"{type(exc).__name__}: {exc}"})
    del llm


if __name__ == "__main__":
    main()

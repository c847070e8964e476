"""kvtier analyze: the reuse bound and curves against brute force, the readers, cost, and the
CLI. Breakers live in test_analyze_breakers.py, the HTML page in test_analyze_html.py."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.analyze import analysis, cost, readers, replay, synth
from kvtier.policies import DEFAULT_POLICY, POLICIES

ROOT = Path(__file__).resolve().parents[1]
# KVTIER_TRACE points elsewhere (a worktree that is not next to shared/)
TRACE = Path(os.environ.get("KVTIER_TRACE", ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"))
PRICES = ROOT / "kvtier" / "analyze" / "prices"


# --- brute force: prefix identity by token slices, no hashing, no kvtier policy -------------------

def _chunks(t: list[int], C: int) -> list[tuple[int, ...]]:
    """Each chunk named by the whole prefix up to its end (what a chained key stands for)."""
    return [tuple(t[: min(s + C, len(t))]) for s in range(0, len(t), C)]


def brute_bound(logs: list[list[int]], C: int) -> list[int]:
    out = []
    for j, t in enumerate(logs):
        best = 0
        for q in logs[:j]:
            k = 0
            while k * C < len(t) and t[k * C: (k + 1) * C] == q[k * C: (k + 1) * C] and \
                    t[: (k + 1) * C] == q[: (k + 1) * C]:
                k += 1
            best = max(best, min(k * C, len(t)))
        out.append(best)
    return out


def brute_replay(logs: list[list[int]], C: int, cap: int, victim: str) -> list[int]:
    """The replay loop with a plain list: ``lru`` evicts the least recently touched, ``min``
    the one whose next touch is farthest (scanning the future)."""
    seq = [c for t in logs for c in _chunks(t, C)]
    cache: list[tuple[int, ...]] = []  # least recent first
    pos = 0
    out = []
    for t in logs:
        cs = _chunks(t, C)
        k = 0
        while k < len(cs) and cs[k] in cache:
            k += 1
        out.append(len(t) if k == len(cs) else k * C)
        for i, c in enumerate(cs):
            pos += 1
            if c in cache:
                cache.remove(c)
            elif i >= k and len(cache) >= cap:
                if victim == "lru":
                    cache.pop(0)
                else:
                    def nxt(x: tuple[int, ...], now: int = pos) -> int:
                        return next((n for n in range(now, len(seq)) if seq[n] == x), len(seq) + 1)
                    far = max(cache, key=lambda x: (nxt(x), -cache.index(x)))
                    cache.remove(far)
            cache.append(c)
    return out


def random_token_log(seed: int, n: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    logs: list[list[int]] = []
    for _ in range(n):
        if logs and rng.random() < 0.7:
            base = rng.choice(logs)
            t = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(0, 9))]
        else:
            t = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        logs.append(t or [0])
    return logs


def write_tokens(path: Path, logs: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"prompt_token_ids": t, "timestamp": i}) + "\n" for i, t in enumerate(logs)))
    return path


@pytest.mark.parametrize("seed", range(6))
def test_bound_and_curve_equal_brute_force(tmp_path: Path, seed: int) -> None:
    C = 3
    logs = random_token_log(seed)
    log = readers.read_log(write_tokens(tmp_path / "t.jsonl", logs), chunk_tokens=C)
    doc = analysis.analyze(log, analysis.Options(capacities=(1, 2, 4, 8, 1000), policies=("lru", "belady")))
    total = sum(map(len, logs))
    assert doc["bound"]["hit_tokens"] == sum(brute_bound(logs, C))
    assert doc["log"]["prompt_tokens"] == total
    for p in doc["curve"]:
        want = sum(brute_replay(logs, C, p["capacity_chunks"], "lru" if p["policy"] == "lru" else "min"))
        assert p["hit_tokens"] == want, p
        assert p["hit_ratio"] == round(want / total, 6)
    # a cache that holds everything serves the bound, whatever the policy
    assert {p["hit_tokens"] for p in doc["curve"] if p["capacity_chunks"] == 1000} == {doc["bound"]["hit_tokens"]}


def test_every_registered_policy_is_replayed_and_none_beats_the_bound(tmp_path: Path) -> None:
    logs = random_token_log(11, n=150)
    log = readers.read_log(write_tokens(tmp_path / "t.jsonl", logs), chunk_tokens=2)
    doc = analysis.analyze(log)
    assert doc["policies"][0] == DEFAULT_POLICY and doc["default_policy"] == DEFAULT_POLICY
    assert set(doc["policies"]) == {*POLICIES, "belady"}
    assert all(p["hit_tokens"] <= doc["bound"]["hit_tokens"] for p in doc["curve"])
    # the curve entry of each policy is a replay through the registry's own policy object
    for name in POLICIES:
        for p in (p for p in doc["curve"] if p["policy"] == name):
            assert p["hit_tokens"] == int(replay.replay(log.requests, POLICIES[name](), p["capacity_chunks"]).sum())


def test_ttl_expires_after_the_gap(tmp_path: Path) -> None:
    p = tmp_path / "ttl.jsonl"
    t = list(range(8))
    p.write_text("".join(json.dumps({"tokens": t, "timestamp": ts}) + "\n" for ts in (0, 10, 100, 105)))
    log = readers.read_log(p, chunk_tokens=4)
    assert replay.with_ttl(log.requests, 20).tolist() == [0, 8, 0, 8]
    assert replay.with_ttl(log.requests, 1000).tolist() == [0, 8, 8, 8]


def test_groups_by_tenant_and_model_and_isolation(tmp_path: Path) -> None:
    p = tmp_path / "g.jsonl"
    shared = list(range(100, 116))
    rows = [{"tokens": shared + [i], "tenant": f"t{i % 2}", "model": "m"} for i in range(6)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    doc = analysis.analyze(readers.read_log(p, chunk_tokens=4), analysis.Options(policies=("lru",)))
    assert doc["bound"]["hit_tokens"] == 5 * 16
    assert [(g["name"], g["requests"]) for g in doc["by_tenant"]] == [("t0", 3), ("t1", 3)]
    assert doc["by_model"][0]["bound_hit_ratio"] == round(80 / 102, 6)
    iso = analysis.analyze(readers.read_log(p, chunk_tokens=4, isolate_tenants=True), analysis.Options(policies=("lru",)))
    assert iso["bound"]["hit_tokens"] == 4 * 16  # the first request of each tenant misses
    assert doc["top_prefixes"][0]["requests"] == 5 and doc["top_prefixes"][0]["prefix_tokens"] == 16


@pytest.mark.skipif(not TRACE.is_file(), reason=f"Mooncake trace not found at {TRACE} (see ../shared/traces/README.md)")
def test_reads_the_mooncake_trace() -> None:
    log = readers.read_log(TRACE)
    assert (log.source, len(log.requests), log.chunk_tokens) == ("mooncake", 3993, 512)
    assert sum(len(r.keys) for r in log.requests) == 121877
    assert len({k for r in log.requests for k in r.keys}) == 43924
    assert log.requests[0].timestamp == 0.0 and log.requests[2].timestamp == 0.04  # ms -> s
    assert log.requests[0].output_tokens == 6


@pytest.mark.parametrize("line,needle", [
    ("not json", ":1: not JSON"),
    ('{"tokens": [1, -2]}', "'tokens' must be a list of non-negative integers"),
    ('{"foo": 1}', "no prompt"),
    ('{"prompt": "hi"}', "needs --tokenizer"),
    ('{"hash_ids": [1, 2], "input_length": 5000}', "does not fit 2 blocks"),
    ('{"tokens": [1], "timestamp": "yesterday"}', "not ISO-8601"),
    ('{"hash_ids": [1, 18446744073709551616], "input_length": 1000}', ":1: 'hash_ids' must be a list of non-negative integers below 2**64; item 1"),
    ('{"tokens": [1, 4294967296]}', ":1: 'tokens' must be a list of non-negative integers below 2**32; item 1"),
    ('{"tokens": [1], "timestamp": NaN}', ":1: 'timestamp' nan is not a finite number"),
    ('{"tokens": [1], "timestamp": 1e400}', ":1: 'timestamp' inf is not a finite number"),
    pytest.param('{"tokens": [1], "timestamp": 1' + "0" * 400 + '}', ":1: 'timestamp' .* is not a finite number", id="400-digit-timestamp"),
    # finite but beyond any calendar: 1e308 ms made a 1e305 s log (and per-day rates of 0)
    ('{"hash_ids": [1], "input_length": 10, "timestamp": 1e308}', ":1: 'timestamp' 1e+308 (ms) is out of range"),
    ('{"tokens": [1], "timestamp": 3e11}', ":1: 'timestamp' 300000000000.0 (s) is out of range"),
    # json recurses per nesting level: a RecursionError traceback before
    pytest.param('{"tokens": [1], "x": ' + "[" * 100_000 + "]" * 100_000 + "}", ":1: JSON nested too deeply", id="deep-nest"),
    # labels are strings: an object became its str(), and model 5 merged with "5"
    ('{"tokens": [1], "tenant": {"a": 1}}', ":1: 'tenant' must be a string, got dict"),
    ('{"tokens": [1], "user": ["x"]}', ":1: 'user' must be a string, got list"),
    ('{"hash_ids": [1], "input_length": 10, "model": 5}', ":1: 'model' must be a string, got int 5"),
    # per-block content hashes, not prefix-chained ids: the bound read 0.93 with every policy ~0.005
    ('{"hash_ids": [1, 2, 1], "input_length": 1500}', ":1: 'hash_ids' are not prefix-chained: item 2 (id 1) follows id 2 here but starts a prompt"),
])
def test_bad_lines_are_named(tmp_path: Path, line: str, needle: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    with pytest.raises(readers.LogError, match=needle.replace("[", r"\[").replace("]", r"\]").replace("**", r"\*\*")
                       .replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        readers.read_log(p)


def test_hash_ids_must_be_prefix_chained(tmp_path: Path) -> None:
    """An id under a second parent on a later line is refused, naming that line; chained ids
    shared by many prompts (at one depth, after one id) are read, in every model namespace."""
    p = tmp_path / "mc.jsonl"
    ok = [{"hash_ids": [1, 2, 3], "input_length": 1536}, {"hash_ids": [1, 2, 4], "input_length": 1536},
          {"hash_ids": [1, 5], "input_length": 1024}, {"hash_ids": [1, 2], "input_length": 1024, "model": "b"}]
    p.write_text("".join(json.dumps(r) + "\n" for r in ok))
    assert len(readers.read_log(p).requests) == 4
    p.write_text("".join(json.dumps(r) + "\n" for r in ok) + '{"hash_ids": [7, 2], "input_length": 1024}\n')
    with pytest.raises(readers.LogError, match=r"mc\.jsonl:5: 'hash_ids' are not prefix-chained: item 1 \(id 2\) "
                                              r"follows id 7 here but follows id 1 earlier"):
        readers.read_log(p)
    p.write_text('{"hash_ids": [1, 2], "input_length": 1024}\n{"hash_ids": [2], "input_length": 512}\n')
    with pytest.raises(readers.LogError, match=r"mc\.jsonl:2: .* \(id 2\) starts a prompt here but follows id 1"):
        readers.read_log(p)


def test_a_few_unchained_ids_in_a_large_trace_warn(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A trace's own glitch (one id under a second parent among thousands of blocks) must not
    make it unreadable: a warning naming the first, and the figures."""
    lines = [{"hash_ids": [1, 10 + i % 50, 100 + i], "input_length": 1536} for i in range(400)]
    lines.append({"hash_ids": [7, 11], "input_length": 1024})  # id 11 followed id 1 until here
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in lines))
    with caplog.at_level(logging.WARNING, logger="kvtier.analyze"):
        got = readers.read_log(p)
    assert len(got.requests) == 401
    assert "1 of 1202 blocks follow another id" in caplog.text and "mc.jsonl:401" in caplog.text


def test_gzip_and_non_utf8_logs(tmp_path: Path) -> None:
    """A gzip-compressed log reads as the plain one; a non-UTF-8 line or a truncated gzip
    stream is a LogError naming the file and line."""
    import gzip

    logs = random_token_log(1, 10)
    plain = readers.read_log(write_tokens(tmp_path / "t.jsonl", logs), chunk_tokens=2)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "t.jsonl").read_bytes()))
    assert [r.keys for r in readers.read_log(gz, chunk_tokens=2).requests] == [r.keys for r in plain.requests]
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gz.read_bytes()[:-12])
    with pytest.raises(readers.LogError, match=r"cut\.jsonl\.gz:\d+: cannot decompress"):
        readers.read_log(cut)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"tokens": [1, 2]}\n{"tokens": [1, 2], "tenant": "caf\xe9"}\n')
    with pytest.raises(readers.LogError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte 0xe9"):
        readers.read_log(latin1)


def test_mooncake_trace_ignores_chunk_tokens_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    p = tmp_path / "mc.jsonl"
    p.write_text('{"hash_ids": [1, 2], "input_length": 1000}\n')
    with caplog.at_level("WARNING", logger="kvtier.analyze.readers"):
        assert readers.read_log(p).chunk_tokens == 512 and not caplog.records
        assert readers.read_log(p, chunk_tokens=16).chunk_tokens == 512
    assert "--chunk-tokens 16 is not used" in caplog.records[0].getMessage()


def test_text_logs_use_a_local_tokenizer(tmp_path: Path) -> None:
    tok = readers.load_tokenizer(str(synth.build_tokenizer(tmp_path / "tok")))
    p = tmp_path / "text.jsonl"
    p.write_text(json.dumps({"prompt": "alpha bravo"}) + "\n" +
                 json.dumps({"messages": [{"role": "user", "content": "alpha bravo"}]}) + "\n")
    log = readers.read_log(p, tokenizer=tok, chunk_tokens=2)
    assert log.source == "text" and log.requests[0].tokens == len(tok("alpha bravo", add_special_tokens=False)["input_ids"])
    with pytest.raises(readers.LogError, match="not a directory"):
        readers.load_tokenizer(str(tmp_path / "missing"))
    # A chat template that raises (non-alternating roles, as Mistral's does): named, not a traceback.
    tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'user' and not loop.first %}"
                         "{{ raise_exception('roles must alternate') }}{% endif %}{{ m['content'] }}{% endfor %}")
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}) + "\n")
    with pytest.raises(readers.LogError, match=r"text\.jsonl:1: the tokenizer's chat template rejects .*roles must alternate"):
        readers.read_log(p, tokenizer=tok, chunk_tokens=2)


# --- cost ------------------------------------------------------------------------------------------

def test_shipped_price_tables_load_and_price_hits() -> None:
    for f in PRICES.iterdir():
        assert cost.load_prices(f), f
    small = cost.select(cost.load_prices(PRICES / "example-hosted-api.yaml"), "example-small")
    assert small.cache_read_multiplier == pytest.approx(0.1) and small.cache_write_multiplier == pytest.approx(1.25)
    # 1M prompt tokens, 600k served: 0.8*(0.6*0.1 + 0.4*1.25) = 0.448 vs 0.8 without a cache
    assert small.saved(1_000_000, 600_000) == pytest.approx(0.8 - 0.448)


@pytest.mark.parametrize("text,needle", [
    ("models: []", "non-empty 'models'"),
    ("models: [{model: a, cache_read_multiplier: 0.1, cache_write_multiplier: 1}]", "missing 'input_per_mtok'"),
    ("models: [{model: a, input_per_mtok: 1, cache_write_multiplier: 1}]", "missing cache_read_multiplier"),
    ("models: [{model: a, input_per_mtok: -1}]", "'input_per_mtok' must be a non-negative number"),
])
def test_bad_price_tables_are_named(tmp_path: Path, text: str, needle: str) -> None:
    p = tmp_path / "p.yaml"
    p.write_text(text)
    with pytest.raises(cost.PriceError, match=needle):
        cost.load_prices(p)


def test_money_in_the_document(tmp_path: Path) -> None:
    logs = random_token_log(3)
    price = cost.select(cost.load_prices(PRICES / "example-hosted-api.yaml"), None)
    doc = analysis.analyze(readers.read_log(write_tokens(tmp_path / "t.jsonl", logs), chunk_tokens=2),
                           analysis.Options(price=price, policies=("lru",)))
    total = doc["log"]["prompt_tokens"]
    for p in doc["curve"]:
        assert p["money_saved"] == round(price.saved(total, p["hit_tokens"]), 6)
        assert p["money_saved_per_day"] == round(price.saved(total, p["hit_tokens"]) * 86400 / doc["log"]["duration_s"], 6)


# --- the command -------------------------------------------------------------------------------------

def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", "analyze", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=300)


def test_cli_json_keys_and_errors(tmp_path: Path) -> None:
    log = write_tokens(tmp_path / "t.jsonl", random_token_log(5))
    r = _cli(str(log), "--json", "-q", "--chunk-tokens", "2", "--capacities", "4,8,16",
             "--prices", str(PRICES / "example-self-hosted.yaml"))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert list(doc) == ["schema", "log", "bound", "default_policy", "policies", "curve", "ttl", "by_tenant",
                         "by_model", "top_prefixes", "breakers", "cost", "seconds"]
    assert sorted({p["capacity_tokens"] for p in doc["curve"]}) == [4, 8, 16]
    bad = _cli(str(log), "--policies", "nope", "-q")
    assert bad.returncode == 2 and "unknown policy 'nope'" in bad.stderr
    trailing = _cli(str(log), "--policies", "lru,", "-q", "--json", "--chunk-tokens", "2", "--capacities", "4")
    assert trailing.returncode == 0 and list(json.loads(trailing.stdout)["policies"]) == ["lru"], trailing.stderr
    empty = _cli(str(log), "--policies", " ,", "-q")
    assert empty.returncode == 2 and "--policies ' ,': no policy name" in empty.stderr
    missing = _cli(str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert _cli().returncode == 2
    summary = _cli(str(log), "-q", "--chunk-tokens", "2")
    assert summary.returncode == 0 and "perfect prefix cache (the bound)" in summary.stdout


def test_help_lists_analyze_without_importing_the_analysis() -> None:
    code = ("import sys, kvtier.cli as c; c.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith(('kvtier.analyze.', 'matplotlib', 'transformers'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "['kvtier.analyze.command']", r.stdout + r.stderr
    h = subprocess.run([sys.executable, "-m", "kvtier.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert "analyze" in h.stdout


def test_prompt_heads_kept_for_an_even_bounded_sample(tmp_path: Path) -> None:
    p = tmp_path / "many.jsonl"
    p.write_text("".join(json.dumps({"tokens": [i % 7, i]}) + "\n" for i in range(5000)))
    log = readers.read_log(p, keep_heads=100)
    kept = [r.index for r in log.requests if r.head is not None]
    assert 100 <= len(kept) <= 200
    gaps = {b - a for a, b in zip(kept, kept[1:])}
    assert len(gaps) == 1 and kept[0] == 0 and kept[-1] + gaps.pop() >= 5000  # evenly over the whole log
    assert all(r.tokens == 2 and len(r.keys) == 1 for r in log.requests)  # the keys of every request stay

"""``kvtier demo`` end to end: the real command in real processes (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.kvtier_servers import start_server

ROOT = Path(__file__).resolve().parent.parent


def _demo(*args: str, timeout: float = 300) -> tuple[dict[str, Any], str]:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--json", *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stdout


def test_demo_defaults_reuse_the_prefix_in_a_fresh_process() -> None:
    report, text = _demo()
    assert report["outputs_identical"] is True
    assert report["tokens_cold"] == report["tokens_warm"] and len(report["tokens_warm"]) == 16
    assert report["prefill_tokens_saved"] == report["prompt_tokens"] - 1 > 0
    assert report["prefilled_tokens_cold"] == report["prompt_tokens"]
    assert report["prefilled_tokens_warm"] == 1
    assert report["hits_per_tier"] and sum(report["hits_per_tier"].values()) > 0
    assert report["hits_per_tier"].keys() <= {"cpu", "disk"}
    for key in ("ttft_cold_s", "ttft_warm_s", "speedup"):
        assert isinstance(report[key], float) and report[key] > 0
    assert report["processes"][0] != report["processes"][1]  # the warm run is another process
    # The restore-vs-read figure: 5 back-to-back (restore, read) pairs from the serving tier.
    assert len(report["restore_vs_tier_read_pairs"]) == 5
    assert all(r > 0 for r in report["restore_vs_tier_read_pairs"])
    assert report["restore_vs_tier_read"] == sorted(report["restore_vs_tier_read_pairs"])[2]
    assert report["restore_gbps"] > 0 and report["tier_read_gbps"] > 0
    assert "outputs identical:     yes" in text and "time to first token" in text


def test_demo_through_a_kvtier_server(tmp_path: Path) -> None:
    server = start_server(tmp_path / "srv", "--slot-bytes", "4MiB")
    try:
        report, _ = _demo("--preset", "test", "--prefix-tokens", "512", "--chunk-tokens", "64",
                          "--server", server.address)
    finally:
        server.stop()
    assert report["outputs_identical"] is True
    assert report["tiers"] == ["cpu", "grpc"]
    # The warm process has a fresh cpu tier: every chunk came from the server.
    assert report["hits_per_tier"] == {"grpc": 9}
    assert len(report["restore_vs_tier_read_pairs"]) == 5  # each restore re-read the server
    assert report["prefill_tokens_saved"] == 512 + 64 - 1


def test_demo_dir_is_kept_and_reused(tmp_path: Path) -> None:
    args = ("--preset", "test", "--prefix-tokens", "256", "--chunk-tokens", "64", "--dir", str(tmp_path))
    first, _ = _demo(*args)
    assert first["saved_chunks_cold"] == 5 and (tmp_path / "disk").is_dir()
    second, _ = _demo(*args)  # the "cold" phase now finds the chunks the first run left
    assert second["saved_chunks_cold"] == 0 and second["outputs_identical"] is True
    assert second["tokens_warm"] == first["tokens_warm"]


def test_demo_prompt_shorter_than_a_chunk_and_the_warm_up() -> None:
    """An 8-token prompt (the warm-up forward is 33 tokens, a chunk 64): one partial chunk is
    saved and restored, and greedy outputs still match (it crashed in the warm-up once)."""
    report, _ = _demo("--preset", "test", "--prefix-tokens", "5", "--question-tokens", "3",
                      "--new-tokens", "4", "--chunk-tokens", "64")
    assert report["outputs_identical"] is True and report["prompt_tokens"] == 8
    assert report["prefill_tokens_saved"] == 7 and report["prefilled_tokens_warm"] == 1


def test_cli_help() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--help"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, check=True).stdout
    assert "--json" in out and "--server" in out and "fresh process" in out
    bad = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--new-tokens", "0"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert bad.returncode == 2 and "expected an integer >= 1" in bad.stderr
    word = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--prefix-tokens", "abc"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
    assert word.returncode == 2 and "--prefix-tokens: expected an integer >= 1, got 'abc'" in word.stderr
    assert "_positive" not in word.stderr


def test_a_dir_that_cannot_hold_the_disk_tier_is_one_error_line(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--preset", "test", "-q",
                           "--prefix-tokens", "64", "--chunk-tokens", "16", "--dir", str(afile)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot be created" in proc.stderr and str(afile) in proc.stderr


def test_a_bad_or_dead_server_is_said_before_any_phase_runs() -> None:
    for server, code, message in (("garbage", 2, "'garbage' is not HOST:PORT"),
                                  ("127.0.0.1:0", 2, "is not HOST:PORT"),
                                  ("127.0.0.1:1", 2, "no kvtier-server answers at 127.0.0.1:1")):
        proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "demo", "--server", server],
                              capture_output=True, text=True, timeout=60, cwd=ROOT, check=False)
        assert proc.returncode == code and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and "cold" not in proc.stdout

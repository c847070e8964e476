"""scripts/gpu_acceptance.py's CPU-checkable parts: help, argument checks, the simulated-device
part, and a non-zero exit when asked for the GPU part on a machine without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_acceptance.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{ROOT / 'connectors'}")
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=300)


def test_help_names_every_part() -> None:
    r = _run("--help")
    assert r.returncode == 0
    for word in ("--sim-only", "h2d_pinned_gbps", "restore_vs_pinned", "forward_thread_max_ms",
                 "races_ok", "vllm_outputs_identical", "warm_ttft_vs_cold", "save_throughput_ratio"):
        assert word in r.stdout, word


@pytest.mark.parametrize("args, message", [
    (["--seeds", "0"], "--seeds must be in [1, 1000], got 0"),
    (["--chunks", "999"], "--chunks must be in [1, 256]"),
    (["--model", "/nonexistent-model"], "--model '/nonexistent-model' has no config.json"),
    (["--out", "/nonexistent-dir/x.json"], "--out '/nonexistent-dir/x.json': directory does not exist"),
])
def test_bad_arguments_are_refused_by_name(args: list[str], message: str) -> None:
    r = _run(*args)
    assert r.returncode == 2 and message in r.stderr


def test_sim_only_runs_the_scenarios_and_ends_with_one_json_object(tmp_path: Path) -> None:
    out = tmp_path / "acc.json"
    r = _run("--sim-only", "--seeds", "2", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    assert last["sim_races_ok"] is True and last["sim"]["failures"] == []
    assert last["skipped"] == {"gpu": "--sim-only"} and last["races_ok"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_a_gpu_the_acceptance_run_fails() -> None:
    r = _run("--seeds", "1")
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 1 and last["skipped"]["gpu"] == "no CUDA device"

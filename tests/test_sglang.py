"""SGLang HiCache backend checks, run in the SGLang venv (tests/sglang_checks/check_*.py).

SGLang pins its own torch and transformers, so it lives in a venv of its own
(``$KVTIER_SGLANG_VENV``, default /work/venvs/sglang, built by scripts/test.sh) and never in this
environment. Each test here runs one check module with that venv's pytest in a subprocess, with
the test-only torchvision stub (tests/stubs) on its path. Without the venv the tests skip,
except in CI (``CI=true``), where a missing venv is a failure: CI must run them.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("KVTIER_SGLANG_VENV", "/work/venvs/sglang"))
PYTHON = VENV / "bin" / "python"


def require_venv() -> None:
    """Skip without the venv, except in CI (``CI=true``), where that fails."""
    if not PYTHON.exists():
        msg = f"SGLang venv absent ({PYTHON}); scripts/test.sh creates it"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg + " (CI must run the SGLang checks)")
        pytest.skip(msg)


def venv_env() -> dict[str, str]:
    """The environment a venv process needs: kvtier, the connectors, the torchvision stub and the
    check helpers on its path; SGLang's fault injection off unless a check turns it on."""
    paths = [ROOT, ROOT / "connectors", ROOT / "tests" / "stubs", ROOT / "tests", ROOT / "tests" / "sglang_checks"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, paths))}
    env.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", None)
    env.pop("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", None)
    return env


def run_checks(*modules: str, timeout: float = 900) -> None:
    require_venv()
    cmd = [str(PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
           *(f"tests/sglang_checks/{m}" for m in modules)]
    proc = subprocess.run(cmd, cwd=ROOT, env=venv_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} -> rc {proc.returncode}\n{proc.stdout[-12000:]}\n{proc.stderr[-4000:]}"


def test_sglang_venv_keeps_its_packages_to_itself() -> None:
    """The venv's sglang must not be importable here (it would bring its own pins)."""
    import importlib.util

    import compressed_tensors
    import transformers

    assert importlib.util.find_spec("sglang") is None
    for mod in (transformers, compressed_tensors):
        assert not str(mod.__file__).startswith(str(VENV)), f"{mod.__name__} comes from {VENV}"


def test_backend_on_real_sglang_pools_every_layout_tier_and_failure() -> None:
    run_checks("check_backend.py", "check_pool_kinds.py", "check_tiers.py", "check_usage.py", "check_readahead.py")


def test_controller_threads_faults_two_tp_ranks_and_pages_shared_with_transformers() -> None:
    run_checks("check_controller.py", "check_xengine.py", "check_tp.py")


def test_attach_refusals_weights_revision_slots_and_placement_on_a_cluster() -> None:
    run_checks("check_attach.py", "check_placement.py")

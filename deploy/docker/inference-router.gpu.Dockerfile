# syntax=docker/dockerfile:1.7
# GPU image for the inference-router and for the Ray GPU workers that host its vLLM replicas.
#
# vLLM pins its own torch (CUDA) and transformers, so this image is a separate environment: one
# resolve of requirements/vllm.txt together with looprl's runtime dependencies minus torch and
# transformers (vLLM chooses those), then looprl itself with --no-deps. requirements.lock is not
# applied here: it pins the CPU torch. ray stays pinned by pyproject.toml, because the router's Ray
# client and the cluster must run the same Ray and Python version.
#
# The CUDA driver comes from the host (NVIDIA container toolkit / device plugin); the CUDA
# runtime libraries come with the torch wheels that vLLM pulls, so a slim Python base suffices.
#
#   docker build -f deploy/docker/inference-router.gpu.Dockerfile -t looprl/inference-router-gpu .

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml requirements/vllm.txt ./
RUN python -c "import tomllib; deps = tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']; print('\n'.join(d for d in deps if not d.startswith(('torch', 'transformers'))))" \
      > /tmp/deps.txt \
 && pip install -r vllm.txt -r /tmp/deps.txt \
 && python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
COPY README.md ./
COPY protos ./protos
COPY services ./services
COPY gateway ./gateway
COPY bench ./bench
RUN pip install --no-deps . \
 && python -c "import services.kit.rpc.server, services.inference_router.config"

FROM ${PYTHON_IMAGE} AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 looprl \
 && useradd --uid 10001 --gid 10001 --home-dir /home/looprl --create-home --shell /usr/sbin/nologin looprl \
 && install -d -o 10001 -g 10001 /var/lib/looprl
COPY --from=build /opt/venv /opt/venv
COPY deploy/healthcheck.py /usr/local/bin/looprl-healthcheck
COPY --chmod=755 deploy/docker/entrypoint.sh /usr/local/bin/looprl-entrypoint
COPY configs /app/configs
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/looprl \
    RAY_USAGE_STATS_ENABLED=0 \
    LOOPRL_HOST=0.0.0.0 \
    LOOPRL_GRPC_PORT=50051 \
    LOOPRL_METRICS_PORT=9464 \
    LOOPRL_STATE_DIR=/var/lib/looprl
WORKDIR /app
USER 10001:10001
EXPOSE 50051 9464
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "/usr/local/bin/looprl-healthcheck"]
ENTRYPOINT ["tini", "--", "looprl-entrypoint", "services.inference_router"]

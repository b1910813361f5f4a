# One image for every meshserve service; compose.yaml picks the service per container.
#
#   docker build --target cpu -t meshserve:latest .        # what compose.yaml builds
#   docker build --target gpu -t meshserve:gpu .           # + vLLM (CUDA) for the gpu profile
#
# BASE is any Debian bookworm image: a slim Python image by default, or a bare Debian one
# (Python then comes from Debian's packages). TORCH_INDEX is where the CPU build of torch
# comes from (a PEP 503 index holding torch). The tests build from a local base with
# --network host (tests/docker/images.py).
ARG BASE=python:3.11-slim

# -- what every stage runs on: Python 3.11 and a C compiler -----------------------------------
FROM ${BASE} AS os
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# gcc: the torch engine compiles its CPU kernels for the host it runs on, at first use
# (shared/native.py). Debian's python3 only where the base has no Python.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
        $(command -v python3 >/dev/null || echo python3 python3-venv) \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb

# -- the dependencies, in a venv: rebuilt only when pyproject.toml changes ----------------------
FROM os AS deps
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# The CPU build first, from its own index: PyPI's torch for Linux is a multi-GB CUDA build.
RUN pip install --no-deps --index-url "$TORCH_INDEX" "torch==2.13.0"
COPY pyproject.toml /tmp/pyproject.toml
# The project's dependencies and its `train` extra (LoRA fine-tuning on the TEs).
RUN python -c 'import tomllib; p = tomllib.load(open("/tmp/pyproject.toml", "rb"))["project"]; print("\n".join(p["dependencies"] + p["optional-dependencies"]["train"]))' \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip check \
    && python -c 'import torch; assert torch.__version__.endswith("+cpu"), torch.__version__'

# -- the CPU image: the venv, then the code (a code change rebuilds these layers only) ---------
FROM os AS cpu
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin meshserve \
    && mkdir -p /models /cache \
    && chown meshserve:meshserve /models /cache
COPY --from=deps /opt/venv /opt/venv
COPY docker/meshserve /usr/local/bin/meshserve
COPY docker/meshserve-loadgen /usr/local/bin/meshserve-loadgen
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared shared
COPY loadgen loadgen
COPY devtools devtools
COPY services services
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/app XDG_CACHE_HOME=/cache \
    MESHSERVE_MODELS_DIR=/models MESHSERVE_LOG_FORMAT=json MESHSERVE_HTTP_HOST=0.0.0.0 \
    MESHSERVE_HEALTH_FILE=/tmp/meshserve.health
USER meshserve
EXPOSE 8080
ENTRYPOINT ["meshserve"]

# -- the GPU image: vLLM's CUDA build in a venv of its own, which TEs run the vLLM engine from --
FROM cpu AS gpu
USER root
ARG VLLM_PACKAGE=vllm==0.32.0
RUN python3 -m venv /opt/vllm && /opt/vllm/bin/pip install "$VLLM_PACKAGE"
ENV MESHSERVE_VLLM_PYTHON=/opt/vllm/bin/python MESHSERVE_ENGINE=vllm MESHSERVE_DEVICE=cuda
USER meshserve

# One image for every meshserve service; compose.yaml picks the service per container.
FROM python:3.11-slim
WORKDIR /app
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# A C compiler: the torch engine compiles its CPU decode-attention kernel for the host
# it runs on (services/task_executor/engines/torch_engine/cpu_kernels.py).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch first and pinned, as scripts/lib/venv.sh does.
RUN pip install "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY shared shared
COPY services services
COPY loadgen loadgen
COPY scripts scripts
RUN pip install . "torch==2.13.0"
ENV MESHSERVE_MODELS_DIR=/models MESHSERVE_LOG_FORMAT=json MESHSERVE_HTTP_HOST=0.0.0.0
ENTRYPOINT ["meshserve"]

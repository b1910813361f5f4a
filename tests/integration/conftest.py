from tests.infra import bus, cluster, nats_url, redis_url, store  # noqa: F401

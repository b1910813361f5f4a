"""Stopping `meshserve up` stops every process it started."""

import time

import openai
import pytest

from tests.e2e.conftest import Cluster, processes_of

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]


def test_sigterm_stops_every_process(e2e_models_dir, nats_url, redis_url):
    c = Cluster(e2e_models_dir, nats_url, redis_url, pool_size="1").start()
    try:
        r = openai.OpenAI(base_url=c.url, api_key="x", max_retries=0).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.usage.completion_tokens > 0
        # launcher, 5 services, 1 TE
        assert len(processes_of(c.name)) >= 7
    finally:
        rc = c.stop()
    assert rc == 0
    deadline = time.time() + 5
    while processes_of(c.name) and time.time() < deadline:
        time.sleep(0.1)
    assert processes_of(c.name) == []

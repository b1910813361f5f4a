"""Stopping `meshserve up` stops every process it started; a service whose background loop
dies exits non-zero and is started again."""

import os
import time
from pathlib import Path

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


# Imported by every Python process of the cluster (it is on their PYTHONPATH): the first
# cluster manager's sweeper dies a second after it starts; the one started after it is
# left alone.
FAULT = """
import asyncio, os

MARKER = {marker!r}
try:
    from services.cluster_manager import service as _cm
except Exception:  # a process without the project's packages (an engine's own venv)
    _cm = None
if _cm is not None:
    _sweeper = _cm.ClusterManager._sweeper

    async def _dying_sweeper(self):
        if os.path.exists(MARKER):
            return await _sweeper(self)
        open(MARKER, "w").close()
        await asyncio.sleep(1.0)
        raise RuntimeError("injected fault: the sweeper died")

    _cm.ClusterManager._sweeper = _dying_sweeper
"""


@pytest.mark.slow
def test_a_service_whose_loop_dies_exits_non_zero_and_is_restarted(
    e2e_models_dir, nats_url, redis_url, tmp_path: Path
):
    inject = tmp_path / "inject"
    inject.mkdir()
    marker = tmp_path / "sweeper-died"
    (inject / "sitecustomize.py").write_text(FAULT.format(marker=str(marker)))
    pythonpath = os.pathsep.join(filter(None, [str(inject), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "cluster.log"
    c = Cluster(
        e2e_models_dir,
        nats_url,
        redis_url,
        pool_size="1",
        env={"PYTHONPATH": pythonpath},
        stderr=log,
    ).start()
    try:
        deadline = time.time() + 30
        while "cluster_manager exited with 1; restarting it" not in log.read_text():
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert marker.exists()
        text = log.read_text()
        assert "background task died" in text and "injected fault" in text
        # The fresh cluster manager took over: the cluster serves (and tracks liveness).
        r = openai.OpenAI(base_url=c.url, api_key="x", max_retries=2).chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert r.usage.completion_tokens > 0
    finally:
        rc = c.stop()
    assert rc == 0  # one crash is not a broken service

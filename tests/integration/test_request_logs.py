"""One request through the frontend, a job executor and a task executor: every service's
log lines about it carry its id (the one the client got back), not only an attempt key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog

from services.task_executor.worker import TaskExecutor
from shared.clients import TaskExecutorClient
from shared.embedded import free_port
from shared.messages.scaling import LoadModel
from shared.settings import Settings
from shared.subjects import Subjects
from tests.integration.services import control_plane, wait_health

pytestmark = [pytest.mark.nats, pytest.mark.redis]


@pytest.fixture
def captured() -> Iterator[list[dict[str, Any]]]:
    """Every log event of this process, with the context each was logged in."""
    events: list[dict[str, Any]] = []

    def keep(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        events.append(dict(event))
        raise structlog.DropEvent

    old = structlog.get_config()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            keep,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(0),
        cache_logger_on_first_use=False,
    )
    try:
        yield events
    finally:
        structlog.configure(**old)


async def test_every_service_logs_the_request_id(
    captured: list[dict[str, Any]],
    cluster: str,
    nats_url: str,
    redis_url: str,
    tmp_path: Path,
    demo_model_dir: Path,
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = Settings(
        cluster=cluster,
        models_dir=tmp_path,
        http_port=free_port(),
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=1),
    )
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    async with control_plane(settings, nats_url, redis_url) as run:
        te = await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-l", pool_id="p")
        )
        await asyncio.wait_for(te.ready.wait(), 10)
        tes = TaskExecutorClient(run.items[-1][2], Subjects(cluster), timeout=10)
        assert (await tes.control("te-l", LoadModel(model="demo", path=str(demo_model_dir)))).ok
        await wait_health(base, lambda b: any(t["state"] == "ready" for t in b["task_executors"]))
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        async with aiohttp.ClientSession() as http:
            async with http.post(base + "/v1/chat/completions", json=body) as r:
                assert r.status == 200
                rid = (await r.json())["id"]
        await asyncio.sleep(0.2)  # the TE's last lines follow its last chunk

    about = [e for e in captured if e.get("request_id") == rid]
    said = {e["event"] for e in about}
    # frontend, job executor, task executor: each says something about the request
    for event in ("request accepted", "job received", "job placed", "task accepted"):
        assert event in said, (event, said)
    assert {"task finished", "request finished"} <= said, said
    # No line names one attempt of it without naming the request.
    anonymous = [e for e in captured if "attempt" in e and not e.get("request_id")]
    assert anonymous == [], anonymous

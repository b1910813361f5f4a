"""kill -9 one process of a running cluster while greedy requests are in flight: every
accepted request completes with the output of the same request undisturbed; a killed
frontend's streams end with an error and the restarted one serves new requests."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

from tests.fault.conftest import (
    CALL_TIMEOUT_S,
    Req,
    await_for,
    client_of,
    cluster_whole,
    health,
    kill9,
    pids_of,
    references,
    requests_for,
    start_cluster,
    under_load,
    wait_for,
)

# Each test bounded as a whole (a cluster start and the demo model included).
pytestmark = pytest.mark.timeout(240)

# A killed service is restarted by the launcher (TEs by their node pool) within this.
BACK_S = 45.0


@pytest.fixture(scope="module")
def cluster(fault_models_dir, servers, tmp_path_factory):
    nats, redis = servers
    c = start_cluster(fault_models_dir, nats, redis, tmp_path_factory.mktemp("kills"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reqs() -> list[Req]:
    return requests_for("kill", 6)


@pytest.fixture(scope="module")
def expected(cluster, reqs) -> dict[Req, str]:
    return asyncio.run(references(cluster, reqs))


def _ready_tes(cluster) -> list[dict]:
    body = health(cluster)
    return [te for te in (body or {}).get("task_executors", []) if te["state"] == "ready"]


async def _under_load(cluster, reqs, expected, fault) -> None:
    """The first half of ``reqs`` in flight at the fault, the second half sent right after
    it: every one completes with its undisturbed output."""
    half = len(reqs) // 2
    got = await under_load(cluster, reqs[:half], reqs[half:], fault)
    for r in reqs:
        assert got[r] == expected[r], f"{r} differs from its undisturbed output: {got[r]!r}"


def _kill_one(cluster, role: str) -> int:
    pids = pids_of(cluster, role)
    assert len(pids) == 1, f"{role}: {pids}"
    kill9(pids[0])
    return pids[0]


def _back(cluster, role: str, old: int) -> None:
    wait_for(
        f"{role} restarted",
        lambda: (p := pids_of(cluster, role)) and old not in p,
        BACK_S,
    )
    wait_for("the whole cluster in the view again", lambda: cluster_whole(cluster), BACK_S)


async def _afterwards(cluster, reqs, expected) -> None:
    """The restarted cluster serves as before: the same requests, the same outputs."""
    client = client_of(cluster)
    try:
        got = await asyncio.wait_for(asyncio.gather(*(r.run(client) for r in reqs)), CALL_TIMEOUT_S)
    finally:
        await client.close()
    assert got == [expected[r] for r in reqs]


async def test_a_killed_task_executor_loses_no_request(cluster, reqs, expected):
    killed: list[int] = []

    def fault() -> None:
        busy = sorted(_ready_tes(cluster), key=lambda te: -te["running"])
        assert busy, "no TE holds the model"
        killed.append(busy[0]["pid"])
        kill9(busy[0]["pid"])

    await _under_load(cluster, reqs, expected, fault)
    # The node pool replaces it.
    wait_for(
        "the node pool replaced the killed TE",
        lambda: len(pids_of(cluster, "te")) == 2 and killed[0] not in pids_of(cluster, "te"),
        BACK_S,
    )
    wait_for("the whole cluster in the view again", lambda: cluster_whole(cluster), BACK_S)
    await _afterwards(cluster, reqs, expected)


@pytest.mark.parametrize("role", ["job_executor", "scaler", "cluster_manager"])
async def test_a_killed_service_loses_no_request(cluster, reqs, expected, role):
    killed: list[int] = []
    await _under_load(cluster, reqs, expected, lambda: killed.append(_kill_one(cluster, role)))
    await asyncio.to_thread(_back, cluster, role, killed[0])
    await _afterwards(cluster, reqs, expected)


async def test_a_killed_frontend_ends_its_streams_and_the_new_one_serves(cluster, reqs, expected):
    client = client_of(cluster)
    stream_reqs = [Req(r.prompt, stream=True, max_tokens=400) for r in reqs[:2]]
    chunks = {r: 0 for r in stream_reqs}
    try:
        tasks = [
            asyncio.create_task(r.run(client, lambda n, r=r: chunks.__setitem__(r, n)))
            for r in stream_reqs
        ]
        await await_for("streams started", lambda: all(n >= 3 for n in chunks.values()), 60)
        old = _kill_one(cluster, "frontend")
        t0 = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(*tasks, return_exceptions=True), CALL_TIMEOUT_S
        )
        # The client hears the end at once (the connection dies with the process); it does
        # not wait out its own timeout.
        assert time.monotonic() - t0 < 10
        for res in results:
            # The connection ends mid-body (openai's HTTP layer raises), not a finished stream.
            assert isinstance(res, Exception), res
            assert not isinstance(res, (TimeoutError, openai.APITimeoutError)), res
        await asyncio.to_thread(_back, cluster, "frontend", old)
        for r in reqs[:2]:
            assert await asyncio.wait_for(r.run(client), CALL_TIMEOUT_S) == expected[r]
    finally:
        await client.close()

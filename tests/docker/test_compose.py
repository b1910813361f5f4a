"""`docker compose up` gives a working cluster: the official openai client gets chat
completions through it with the admin key the cluster generated (and nothing without one), a crashed task executor comes back through its restart policy with
no request lost, and `docker compose down` leaves nothing behind."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
import yaml

from tests.docker.conftest import Compose

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


def _client(c: Compose) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{c.url}/v1", api_key=c.admin_key(), timeout=180, max_retries=0)


# The killed-TE test needs a stream still running when the kill lands: past the demo
# model's end of sequence (on a fast host it ends its answer within the kill's latency).
LONG = {"ignore_eos": True}


def _greedy(c: Compose, max_tokens: int, extra: dict[str, object] | None = None) -> str:
    r = _client(c).chat.completions.create(
        model="demo", messages=PROMPT, max_tokens=max_tokens, temperature=0, extra_body=extra
    )
    assert r.usage is not None and r.usage.completion_tokens > 0
    return r.choices[0].message.content or ""


def _streamed(
    c: Compose,
    max_tokens: int,
    first: threading.Event | None = None,
    extra: dict[str, object] | None = None,
) -> tuple[str, str | None]:
    text, finish = [], None
    stream = _client(c).chat.completions.create(
        model="demo",
        messages=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body=extra,
    )
    for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            if first is not None and choice.delta.content:
                first.set()
    return "".join(text), finish


def test_every_service_is_healthy(compose: Compose) -> None:
    for service in ("cluster-manager", "scaler", "job-executor", "frontend", "task-executor"):
        state = compose.inspect(compose.container(service))["State"]
        assert state["Running"] and state["Health"]["Status"] in ("healthy", "starting"), (
            service,
            state,
        )
    for one_shot in ("secrets", "demo-model"):
        state = compose.inspect(compose.container(one_shot))["State"]
        assert state["Status"] == "exited" and state["ExitCode"] == 0, (one_shot, state)


def test_chat_completions_through_compose(compose: Compose) -> None:
    text = _greedy(compose, 24)
    assert text
    streamed, finish = _streamed(compose, 24)
    assert streamed == text
    assert finish in ("stop", "length")
    with pytest.raises(openai.NotFoundError):
        _client(compose).chat.completions.create(model="no-such-model", messages=PROMPT)


def test_the_published_api_asks_for_keys(compose: Compose) -> None:
    """Published on every host interface, the API is not open: no key (or a wrong one) is a
    401 on the API and on the admin routes; the generated admin key manages keys."""
    nobody = openai.OpenAI(base_url=f"{compose.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        nobody.models.list()
    for path in ("/admin/keys", "/admin/tenants"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{compose.url}{path}", timeout=10)
        assert e.value.code == 401, path
    req = urllib.request.Request(
        f"{compose.url}/admin/keys", headers={"Authorization": f"Bearer {compose.admin_key()}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200


def _node_pool_killer(compose: Compose) -> Callable[[], Callable[[], None]]:
    """What kills the task-executor container: SIGKILL to its init (the node pool and its
    TEs die with it), then returns what waits for the restart policy to bring it back. The
    container is looked up now, so the kill itself is immediate."""
    te = compose.container("task-executor")
    before = compose.inspect(te)

    def kill() -> Callable[[], None]:
        os.kill(before["State"]["Pid"], signal.SIGKILL)
        return restarted

    def restarted() -> None:
        deadline = time.monotonic() + 60
        while True:
            after = compose.inspect(te)
            if after["RestartCount"] > before["RestartCount"] and after["State"]["Running"]:
                return
            assert time.monotonic() < deadline, f"not restarted: {after['State']}"
            time.sleep(0.5)

    return kill


def test_killed_task_executor_restarts_and_loses_no_request(compose: Compose) -> None:
    reference = _greedy(compose, 400, LONG)
    kill = _node_pool_killer(compose)
    result: dict[str, object] = {}
    first = threading.Event()

    def in_flight() -> None:
        try:
            result["text"], result["finish"] = _streamed(compose, 400, first, LONG)
        except Exception as e:
            result["error"] = e

    t = threading.Thread(target=in_flight)
    t.start()
    assert first.wait(60), "the request never started streaming"
    restarted = kill()
    assert "text" not in result, "the request finished before the kill: ask for more tokens"
    restarted()
    t.join(timeout=240)
    assert not t.is_alive(), "the in-flight request never finished"
    assert "error" not in result, f"in-flight request failed: {result['error']!r}"
    assert result["text"] == reference
    assert _greedy(compose, 400, LONG) == reference


def test_fine_tuning_through_compose(compose: Compose) -> None:
    """Files on the cache volume the frontend writes and the TEs read; a job trained on the
    idle TE; the adapter served by the demo model's TE."""
    client = _client(compose)
    line = (
        '{"messages": [{"role": "user", "content": "Hi"}, '
        '{"role": "assistant", "content": "Hello"}]}\n'
    )
    f = client.files.create(file=("t.jsonl", (line * 4).encode()), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="demo", training_file=f.id, hyperparameters={"n_epochs": 1, "batch_size": 4}
    )
    deadline = time.monotonic() + 300
    while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in (
        "succeeded",
        "failed",
        "cancelled",
    ):
        assert time.monotonic() < deadline, job
        time.sleep(1)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model in {m.id for m in client.models.list()}
    r = client.chat.completions.create(
        model=job.fine_tuned_model, messages=PROMPT, max_tokens=8, temperature=0
    )
    assert r.usage is not None and r.usage.completion_tokens > 0


OBSERVABILITY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
SCRAPED = {"frontend", "job-executor", "cluster-manager", "scaler", "node-pool"}


def _prometheus(c: Compose, path: str, **query: str) -> dict:
    url = f"{c.prometheus_url}/api/v1/{path}"
    if query:
        url += "?" + urllib.parse.urlencode(query)
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


def _finite(result: list[dict]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def test_observability_profile_scrapes_every_service_and_every_panel_has_data(
    compose: Compose,
) -> None:
    """The profile's Prometheus (running since `up`, through the tests above: cold starts, a
    TE killed and restarted, a fine-tuning job) finds every service up, loads the alert
    rules, and answers every query of the shipped dashboard with data after more traffic."""
    # A scale-up Prometheus sees happen (the earlier ones may all have come before its first
    # scrape of the frontend on a fast host): the node pool killed first, the model loaded
    # again on its return by the traffic below, once every target is scraped again.
    _node_pool_killer(compose)()()
    deadline = time.monotonic() + 120
    while True:
        try:
            targets = _prometheus(compose, "targets")["activeTargets"]
        except OSError as e:
            targets = [{"labels": {"job": "?"}, "health": repr(e)}]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        if set(health) == SCRAPED and all(h == "up" for h in health.values()):
            break
        assert time.monotonic() < deadline, f"targets: {health}\n{targets}"
        time.sleep(2)
    # Every alert rule evaluates cleanly: "unknown" until its group's first evaluation (every
    # 15 s, counted from Prometheus's start), so wait for that; "err" fails at once.
    while True:
        rules = _prometheus(compose, "rules")["groups"]
        assert [g["name"] for g in rules] == ["meshserve"]
        health = {r["name"]: (r["health"], r.get("lastError", "")) for r in rules[0]["rules"]}
        assert not [h for h in health.values() if h[0] == "err"], health
        if all(h == "ok" for h, _ in health.values()):
            break
        assert time.monotonic() < deadline, health
        time.sleep(2)
    # Traffic in rounds with scrapes (every 5 s) between, so every rate has an increase: two
    # at least, and more while a panel has none (a TE's series begins at its first scrape,
    # so a rate needs a second with more on it: one that loaded during a round, or took its
    # first requests in the last, has one sample or one value).
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    for rounds in range(1, 6):
        for _ in range(3):
            _greedy(compose, 16)
            _streamed(compose, 16)
        time.sleep(12)
        if rounds < 2:
            continue
        empty = []
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                data = _prometheus(compose, "query", query=target["expr"])
                if not _finite(data["result"]):
                    empty.append((panel["title"], target["expr"], data["result"]))
        if not empty:
            break
    assert not empty, f"panels without data after {rounds} rounds:\n" + "\n".join(map(str, empty))


def test_observability_profile_config(compose: Compose) -> None:
    """Grafana cannot run here (no image): its service is checked by `config`, with
    Prometheus provisioned as its data source and the dashboard mounted."""
    config = yaml.safe_load(compose("--profile", "observability", "config").stdout)
    grafana = config["services"]["grafana"]
    # docker-compose 1.29 writes volumes as strings, compose v2 as mappings.
    mounts = dict(
        (v["target"], v["source"]) if isinstance(v, dict) else v.split(":")[1::-1]
        for v in grafana["volumes"]
    )
    assert Path(mounts["/etc/grafana/provisioning"]) == OBSERVABILITY / "grafana"
    assert Path(mounts["/var/lib/grafana/dashboards/meshserve.json"]) == (
        OBSERVABILITY / "grafana-dashboard.json"
    )
    assert not compose("ps", "-q", "grafana").stdout.split()


ANONYMOUS = """
import asyncio, nats, redis
async def anonymous_nats():
    try:
        nc = await nats.connect("nats://nats:4222", allow_reconnect=False, connect_timeout=5)
    except Exception as e:
        return type(e).__name__ + ": " + str(e)
    await nc.close()
    return "admitted"
try:
    redis.Redis(host="redis", socket_timeout=5).ping()
    refused_redis = "admitted"
except redis.exceptions.RedisError as e:
    refused_redis = type(e).__name__
print(asyncio.run(anonymous_nats()))
print(refused_redis)
"""


def test_nats_and_redis_admit_only_the_roles(compose: Compose) -> None:
    """The servers refuse anonymous clients; each container holds only its own role's
    credentials (mode 0600; the frontend's include the API's admin key), and the cluster
    serves with them (the tests above)."""
    frontend = compose.container("frontend")
    out = compose.d.run("exec", frontend, "python", "-c", ANONYMOUS).stdout.splitlines()
    assert "admitted" not in out[0] and "uthoriz" in out[0], out
    assert out[1] in ("AuthenticationError", "NoPermissionError", "ResponseError"), out
    listing = compose.d.run("exec", frontend, "ls", "-l", "/run/meshserve").stdout
    assert sorted(line.split()[-1] for line in listing.splitlines()[1:]) == [
        "admin-key",  # the API's (the frontend's role only: the task executor has none)
        "nats-url",
        "redis-url",
    ]
    assert all(line.startswith("-rw-------") for line in listing.splitlines()[1:])
    urls = {
        service: compose.d.run(
            "exec", compose.container(service), "cat", "/run/meshserve/nats-url"
        ).stdout
        for service in ("frontend", "task-executor")
    }
    te = compose.d.run("exec", compose.container("task-executor"), "ls", "/run/meshserve").stdout
    assert "admin-key" not in te.split()
    assert urls["frontend"].startswith("nats://frontend:")
    assert urls["task-executor"].startswith("nats://task_executor:")


def test_gpu_profile_reserves_the_gpus(compose: Compose) -> None:
    # Not started without --profile gpu.
    assert not compose("ps", "-q", "task-executor-gpu").stdout.split()
    config = yaml.safe_load(compose("--profile", "gpu", "config").stdout)
    gpu = config["services"]["task-executor-gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert gpu["environment"]["MESHSERVE_ENGINE"] == "vllm"
    assert gpu["build"]["target"] == "gpu"


def test_down_leaves_nothing_behind(compose: Compose) -> None:
    compose("down", "-v", "--remove-orphans", "--timeout", "10")
    assert compose.leftovers() == {"containers": [], "networks": [], "volumes": []}

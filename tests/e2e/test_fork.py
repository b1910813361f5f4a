"""Two node pools with host caches of their own: a pool that joins while the other's cache
holds the model forks the weights from that pool's weight server instead of reading the
checkpoint, and its instance serves the same greedy output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from shared.embedded import die_with_parent
from tests.e2e.conftest import Cluster, processes_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _get(url: str, path: str) -> str:
    with urllib.request.urlopen(url.removesuffix("/v1") + path, timeout=5) as r:
        return r.read().decode()


def _tes(url: str) -> list[dict]:
    return json.loads(_get(url, "/health"))["task_executors"]


def _wait(what: str, ok, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, what
        time.sleep(0.25)


def test_a_pool_without_the_weights_forks_them_from_one_that_has_them(
    e2e_models_dir: Path, nats_url: str, redis_url: str, tmp_path: Path
) -> None:
    cache_a, cache_b = tmp_path / "cache-a", tmp_path / "cache-b"
    cluster = Cluster(
        e2e_models_dir,
        nats_url,
        redis_url,
        stderr=tmp_path / "cluster.log",
        pool_size="1",
        min_replicas="2",  # one pool of one TE holds one: the second waits for pool b
        max_replicas="2",
        host_cache_dir=str(cache_a),
    ).start()
    pool_b = None
    try:
        client = openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0)

        def ask() -> str:
            r = client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": "Once upon a time"}],
                max_tokens=24,
                temperature=0,
            )
            return r.choices[0].message.content or ""

        _wait(
            "pool a's cache to hold the model",
            lambda: any(
                (c := t["cached_weights"].get("demo")) and c["resident_bytes"] == c["total_bytes"]
                for t in _tes(cluster.url)
            ),
        )
        reference = ask()
        env = {**cluster.env, "MESHSERVE_HOST_CACHE_DIR": str(cache_b)}
        log = (tmp_path / "pool-b.log").open("w")
        pool_b = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "task-executor", "--pool-id", "b"],
            env=env,
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        _wait(
            "an instance on pool b",
            lambda: any(
                t["pool"] == "b" and t["model"] == "demo" and t["state"] == "ready"
                for t in _tes(cluster.url)
            ),
        )
        for _ in range(6):  # both instances serve the same greedy output
            assert ask() == reference

        def step_count(step: str) -> float:
            for line in _get(cluster.url, "/metrics").splitlines():
                if line.startswith("meshserve_scale_step_seconds_count") and f'"{step}"' in line:
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        # It forked: its load fetched every tensor over TCP and read no checkpoint; the
        # scale-up's event (out once the instance served a first token, or 10 s after it
        # turned ready) says so, with that first token.
        _wait("pool b's scale event", lambda: step_count("te_load_fetch") >= 1, timeout=30)
        assert step_count("te_first_token") >= 1
        assert list((cache_b / "tensors").glob("*.t"))  # and keeps them for its host
    finally:
        if pool_b is not None:
            pool_b.terminate()
            pool_b.wait(60)
        cluster.stop()
    assert processes_of(cluster.name) == []

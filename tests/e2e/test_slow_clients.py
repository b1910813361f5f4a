"""A client that stops reading its stream: its writes wait, nobody else's do, and after
frontend.stall_timeout the frontend cuts it and frees its batch slot on the TE."""

from __future__ import annotations

import json
import socket
import time
import urllib.request

import openai
import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]

MSGS = [{"role": "user", "content": "Tell me about the license of this program."}]
# Long enough that the stall guard, not the request, ends the stalled stream; short enough
# that a normal request started once the stalled one is waiting ends well within it.
STALL_S = 8
ASKED = 8000  # ~1.3 MB of SSE events: more than every buffer between the TE and the client


@pytest.fixture(scope="module")
def cluster(e2e_models_dir, nats_url, redis_url):
    c = Cluster(
        e2e_models_dir, nats_url, redis_url, pool_size="1", stall_timeout=str(STALL_S)
    ).start()
    yield c
    c.stop()


def _get(url: str, path: str) -> bytes:
    with urllib.request.urlopen(url.removesuffix("/v1") + path, timeout=5) as r:
        body: bytes = r.read()
    return body


def _metric(url: str, name: str) -> float:
    for line in _get(url, "/metrics").decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _running(url: str) -> int:
    return sum(te["running"] for te in json.loads(_get(url, "/health"))["task_executors"])


def _until(what: str, ready, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.1)


def test_a_stalled_client_is_cut_and_blocks_nobody(cluster):
    client = openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=120)
    client.chat.completions.create(model="demo", messages=MSGS, max_tokens=1)  # loaded
    host, port = cluster.url.removeprefix("http://").removesuffix("/v1").split(":")
    body = json.dumps(
        {
            "model": "demo",
            "messages": MSGS,
            "max_tokens": ASKED,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    stalled = socket.socket()
    # A small receive window: the frontend's writes back up after a few KB the kernel holds.
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect((host, int(port)))
    stalled.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    try:
        # The stalled stream's write is waiting for the client (its buffers are full) ...
        _until(
            "the stalled stream waits", lambda: _metric(cluster.url, "meshserve_waiting_streams")
        )
        assert _metric(cluster.url, "meshserve_stalled_streams_total") == 0
        # ... and a normal stream on the same frontend and TE is served meanwhile.
        t0 = time.monotonic()
        stream = client.chat.completions.create(
            model="demo",
            messages=MSGS,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        served_s = time.monotonic() - t0
        assert chunks[-1].usage.completion_tokens == 16
        assert chunks[-2].choices[0].finish_reason == "length"
        # Not cut yet: the normal stream ran while the stalled one was open and waiting.
        assert _metric(cluster.url, "meshserve_stalled_streams_total") == 0, served_s
        assert _metric(cluster.url, "meshserve_waiting_streams") == 1
        # Then the stall guard cuts it: counted, the connection aborted, the TE slot freed
        # long before the TE produced what was asked.
        _until(
            "the stalled stream is cut",
            lambda: _metric(cluster.url, "meshserve_stalled_streams_total") == 1,
            timeout=STALL_S * 3,
        )
        _until("the stalled generation stops", lambda: _running(cluster.url) == 0, timeout=30)
        received = b""
        stalled.settimeout(10)
        try:
            while chunk := stalled.recv(1 << 16):
                received += chunk
        except ConnectionResetError:
            pass  # aborted with bytes unsent: a reset
        assert received.startswith(b"HTTP/1.1 200")
        assert b"[DONE]" not in received and received.count(b"data: ") < ASKED
        assert _metric(cluster.url, "meshserve_open_streams") == 0
    finally:
        stalled.close()

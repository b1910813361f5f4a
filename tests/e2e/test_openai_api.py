"""The official openai client, unchanged, against a local cluster."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.error
import urllib.request

import openai
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]

MSGS = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the license of this program."},
]


@pytest.fixture(scope="module")
def client(cluster_up) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster_up.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(cluster_up) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=cluster_up.url, api_key="unused", max_retries=0, timeout=120)


def greedy(client: openai.OpenAI, messages=MSGS, max_tokens: int = 24, **kw):
    return client.chat.completions.create(
        model="demo", messages=messages, max_tokens=max_tokens, temperature=0, **kw
    )


def health(url: str) -> dict:
    with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as r:
        return json.loads(r.read())


def test_models_are_listed(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert "demo" in ids
    assert client.models.retrieve("demo").id == "demo"


def test_health_shows_what_each_engine_can_do(client, cluster_up):
    greedy(client, max_tokens=2)  # the demo model is loaded somewhere
    ready = [te for te in health(cluster_up.url)["task_executors"] if te["state"] == "ready"]
    assert ready and ready[0]["engine"] == "torch"
    caps = ready[0]["capabilities"]
    assert set(caps["modes"]) == {"colocated", "prefill", "decode"}
    assert caps["prefix_cache"] and caps["kv_events"] and caps["kv_export"]
    assert ready[0]["role"] == "colocated"  # what the scaler loaded it as


def test_chat_non_streaming(client):
    r = greedy(client)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == "demo"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.prompt_tokens > 10
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_equals_non_streaming(client):
    full = greedy(client, max_tokens=32, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(
        model="demo",
        messages=MSGS,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text == full.choices[0].message.content
    assert finish == ["length"]
    assert chunks[-1].usage.completion_tokens == 32 == full.usage.completion_tokens


def test_greedy_output_is_identical_across_runs(client):
    a, b = greedy(client, max_tokens=40), greedy(client, max_tokens=40)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage == b.usage


async def test_two_concurrent_requests(client, aclient):
    other = [{"role": "user", "content": "Write one sentence about copying and distribution."}]
    alone = [
        greedy(client, MSGS, 30).choices[0].message.content,
        greedy(client, other, 30).choices[0].message.content,
    ]
    together = await asyncio.gather(
        aclient.chat.completions.create(model="demo", messages=MSGS, max_tokens=30, temperature=0),
        aclient.chat.completions.create(model="demo", messages=other, max_tokens=30, temperature=0),
    )
    # Batched with each other, each request still gets exactly its own greedy output.
    assert [r.choices[0].message.content for r in together] == alone


def test_a_repeated_prompt_reports_cached_tokens(client):
    long = [
        {
            "role": "user",
            "content": "Copying and distribution of this file, with or without "
            "modification, are permitted in any medium without royalty. " * 4,
        }
    ]
    first = greedy(client, long, max_tokens=4)
    second = greedy(client, long, max_tokens=4)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Whole 16-token blocks of the prompt are reused; the last token is always recomputed.
    assert cached >= (second.usage.prompt_tokens - 1) // 16 * 16 - 16 > 0
    assert second.choices[0].message.content == first.choices[0].message.content


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model="demo", messages=MSGS, max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_stop_string_cuts_the_output(client):
    full = greedy(client, max_tokens=40, extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(full) > 12
    stop = full[8:12]
    cut = greedy(client, max_tokens=40, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.message.content == full[: full.index(stop)]
    assert cut.finish_reason == "stop"


def test_completions_endpoint(client):
    r = client.completions.create(model="demo", prompt="The license", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 12
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="demo", prompt="The license", max_tokens=12, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=MSGS)
    assert e.value.status_code == 404 and "nope" in str(e.value)


def test_prompt_longer_than_the_context_is_400(client):
    ctx = client.models.retrieve("demo").model_extra["max_model_len"]
    long = [{"role": "user", "content": "word " * (ctx + 10)}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=long, max_tokens=10)
    assert "maximum context length" in str(e.value) and str(ctx) in str(e.value)


def test_bad_input_gets_openai_style_400(cluster_up, client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="demo", messages=MSGS, n=2)
    req = urllib.request.Request(
        cluster_up.url + "/chat/completions",
        data=b"{not json",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 400
    body = json.loads(e.value.read())
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_stops_its_generation(cluster_up, stream):
    """The TE stops generating for a client that is gone, instead of running to max_tokens."""
    import http.client

    def generated() -> int:
        return sum(te["generated_tokens"] for te in health(cluster_up.url)["task_executors"])

    host, port = cluster_up.url.removeprefix("http://").removesuffix("/v1").split(":")
    asked = 8000
    body = json.dumps(
        {
            "model": "demo",
            "messages": MSGS,
            "max_tokens": asked,
            "stream": stream,
            "ignore_eos": True,
        }
    )
    before = generated()
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    deadline = time.time() + 30
    while not any(te["running"] for te in health(cluster_up.url)["task_executors"]):
        assert time.time() < deadline, "the request never started"
        time.sleep(0.1)
    conn.close()  # hang up
    deadline = time.time() + 60
    while any(te["running"] for te in health(cluster_up.url)["task_executors"]):
        assert time.time() < deadline, "the generation never stopped"
        time.sleep(0.2)
    time.sleep(1)  # a last heartbeat with the final count
    # However slow the machine, the TE stopped long before producing what was asked.
    assert generated() - before < asked // 2


def test_request_survives_the_death_of_its_task_executor(cluster_up, client):
    """SIGKILL the TE in the middle of a stream: the frontend resubmits with the tokens so
    far and the client still gets every token it asked for."""
    stream = client.chat.completions.create(
        model="demo",
        messages=MSGS,
        max_tokens=300,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks, killed = [], None
    for c in stream:
        chunks.append(c)
        if killed is None and len(chunks) == 5:
            busy = [te for te in health(cluster_up.url)["task_executors"] if te["running"]]
            if not busy:  # the view lags a heartbeat; any TE with the model will do
                busy = [te for te in health(cluster_up.url)["task_executors"] if te["model"]]
            killed = busy[0]["id"]
            os.kill(busy[0]["pid"], signal.SIGKILL)
    assert killed is not None
    assert chunks[-1].usage.completion_tokens == 300
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # The pool replaces the dead TE.
    deadline = time.time() + 30
    while time.time() < deadline:
        tes = health(cluster_up.url)["task_executors"]
        if len(tes) == 2 and killed not in [te["id"] for te in tes]:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the node pool did not replace the killed TE")


def test_scale_to_zero_after_keep_alive_and_back(cluster_up, client):
    before = greedy(client, max_tokens=4)
    deadline = time.time() + 30
    while time.time() < deadline:
        if all(te["model"] is None for te in health(cluster_up.url)["task_executors"]):
            break
        time.sleep(0.5)
    else:
        pytest.fail("the model was not unloaded after its keep-alive (4 s)")
    after = greedy(client, max_tokens=4)  # scales from zero again
    # Loaded again (some TE holds it) and the same greedy reply as before the unload.
    assert any(te["model"] == "demo" for te in health(cluster_up.url)["task_executors"])
    assert after.usage.completion_tokens == before.usage.completion_tokens > 0
    assert after.choices[0].message.content == before.choices[0].message.content

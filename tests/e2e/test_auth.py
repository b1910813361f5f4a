"""Tenants, API keys and limits on a cluster with auth on, through the official openai client
and the `meshserve keys` / `meshserve tenants` commands."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.error
import urllib.request
from http.client import HTTPConnection

import openai
import pytest

from tests.e2e.conftest import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.nats, pytest.mark.redis]

MSGS = [{"role": "user", "content": "Tell me about the license of this program."}]


@pytest.fixture(scope="module")
def secure(e2e_models_dir, nats_url, redis_url, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("auth") / "admin-key"
    c = Cluster(
        e2e_models_dir, nats_url, redis_url, auth="on", admin_key_file=str(key_file)
    ).start()
    c.admin_key = key_file.read_text().strip()
    yield c
    c.stop()


def meshserve(cluster: Cluster, *args: str) -> str:
    """Run the meshserve command against the cluster; its stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "services.cli", *args, "--url", cluster.url.removesuffix("/v1")],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def client_for(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url, api_key=key, max_retries=0, timeout=120)


def chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        messages=MSGS, temperature=0, **{"model": "demo", "max_tokens": 4, **kw}
    )


def http(cluster: Cluster, method: str, path: str, key: str | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(cluster.url.removesuffix("/v1") + path, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_requests_need_a_valid_key(secure):
    status, body = http(secure, "GET", "/v1/models")
    assert status == 401 and "didn't provide an API key" in body["error"]["message"]
    assert body["error"]["type"] == "authentication_error"
    wrong = "sk-ms-" + "x" * 43
    with pytest.raises(openai.AuthenticationError) as e:
        chat(client_for(secure, wrong))
    assert e.value.status_code == 401 and wrong not in str(e.value) and "xxxx" in str(e.value)
    # Probes stay open and show no secret.
    status, body = http(secure, "GET", "/health")
    assert status == 200 and secure.admin_key not in json.dumps(body)


def test_a_tenant_key_from_the_command_line_serves_and_is_revoked_at_once(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "acme", "--name", "ci").strip()
    assert key.startswith("sk-ms-")
    client = client_for(secure, key)
    assert [m.id for m in client.models.list()] == ["demo"]
    assert chat(client).choices[0].message.content
    listed = meshserve(secure, "keys", "list", "--tenant", "acme")
    key_id = listed.splitlines()[1].split()[0]
    assert key not in listed and key[-4:] in listed
    # A tenant key cannot manage keys.
    status, body = http(secure, "GET", "/admin/keys", key)
    assert status == 403 and body["error"]["type"] == "permission_error"
    meshserve(secure, "keys", "revoke", key_id)
    with pytest.raises(openai.AuthenticationError):
        chat(client)


def test_a_tenant_sees_only_the_models_it_is_granted(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "globex").strip()
    meshserve(secure, "tenants", "set", "globex", "--models", "someone-elses")
    client = client_for(secure, key)
    assert client.models.list().data == []
    with pytest.raises(openai.NotFoundError) as hidden:
        chat(client)
    with pytest.raises(openai.NotFoundError) as missing:
        chat(client, model="no-such-model")
    # The same answer as for a model that does not exist: nothing leaks.
    assert hidden.value.body["code"] == missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("demo")
    meshserve(secure, "tenants", "set", "globex", "--all-models")
    assert chat(client).choices


def test_requests_per_minute_refuse_with_openai_headers(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "rpm").strip()
    meshserve(secure, "tenants", "set", "rpm", "--requests-per-minute", "3")
    client = client_for(secure, key)
    raw = client.chat.completions.with_raw_response.create(
        model="demo", messages=MSGS, max_tokens=2, temperature=0
    )
    assert raw.headers["x-ratelimit-limit-requests"] == "3"
    assert raw.headers["x-ratelimit-remaining-requests"] == "2"
    assert raw.headers["x-ratelimit-reset-requests"].endswith("s")
    chat(client, max_tokens=2)
    chat(client, max_tokens=2, stream=True).close()
    with pytest.raises(openai.RateLimitError) as e:
        chat(client, max_tokens=2)
    assert e.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert 1 <= int(e.value.response.headers["retry-after"]) <= 21
    assert e.value.body["code"] == "rate_limit_exceeded"


async def test_a_hundred_concurrent_requests_against_a_budget_of_ten_admit_exactly_ten(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "burst").strip()
    meshserve(secure, "tenants", "set", "burst", "--requests-per-minute", "10")
    client = openai.AsyncOpenAI(base_url=secure.url, api_key=key, max_retries=0, timeout=120)

    async def one():
        try:
            await client.chat.completions.create(
                model="demo", messages=MSGS, max_tokens=1, temperature=0
            )
            return 200
        except openai.RateLimitError:
            return 429

    got = await asyncio.gather(*(one() for _ in range(100)))
    await client.close()
    assert got.count(200) == 10 and got.count(429) == 90


def test_generated_tokens_are_charged_as_they_stream(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "tpm").strip()
    meshserve(secure, "tenants", "set", "tpm", "--tokens-per-minute", "60")
    client = client_for(secure, key)
    stream = chat(
        client,
        max_tokens=150,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    # The budget (60 tokens, prompt included) ends the stream; one charge batch of slack.
    assert finish == ["length"]
    assert usage.prompt_tokens + usage.completion_tokens <= 60 + 16 + 1
    with pytest.raises(openai.RateLimitError, match="tokens per minute"):
        chat(client)


def test_size_limits_are_clear_400s(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "small").strip()
    meshserve(
        secure, "tenants", "set", "small", "--max-prompt-tokens", "5", "--max-output-tokens", "3"
    )
    client = client_for(secure, key)
    with pytest.raises(openai.BadRequestError, match="more than the 5 your limit allows"):
        chat(client)
    with pytest.raises(openai.BadRequestError, match="more than the 3 your limit allows"):
        client.completions.create(model="demo", prompt="Hi", max_tokens=10)
    # Without max_tokens the tenant's cap applies.
    done = client.completions.create(
        model="demo", prompt="Hi", max_tokens=None, temperature=0, extra_body={"ignore_eos": True}
    )
    assert done.usage.completion_tokens == 3 and done.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer",
        "Bearer ",
        "Basic dXNlcjpwYXNz",
        "bearer sk-ms-" + "a" * 43,
        "Bearer " + "x" * 8000,
        "Bearer sk-ms-\u00e9\u00e8",
        "Bearer sk-ms-\x00\x01",
        "Bearer  sk-ms-  spaced  ",
    ],
)
def test_malformed_authorization_headers_are_401s(secure, header):
    host, port = secure.url.removeprefix("http://").removesuffix("/v1").split(":")
    conn = HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    if header:
        conn.putheader("Authorization", header.encode("utf-8", "surrogateescape"))
    conn.endheaders(b'{"model": "demo", "messages": []}')
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    assert resp.status in (400, 401), (resp.status, body[:200])
    if resp.status == 401:
        assert json.loads(body)["error"]["type"] == "authentication_error"


def test_a_tenants_body_limit_holds_for_chunked_bodies(secure):
    key = meshserve(secure, "keys", "create", "--tenant", "tiny").strip()
    meshserve(secure, "tenants", "set", "tiny", "--max-body-bytes", "2000")
    body = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "x" * 4000}]})
    host, port = secure.url.removeprefix("http://").removesuffix("/v1").split(":")
    for chunked in (False, True):
        conn = HTTPConnection(host, int(port), timeout=10)
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        data = iter([body.encode()]) if chunked else body.encode()
        conn.request(
            "POST", "/v1/chat/completions", body=data, headers=headers, encode_chunked=chunked
        )
        resp = conn.getresponse()
        payload = json.loads(resp.read())
        conn.close()
        assert resp.status == 413, (chunked, payload)
        assert "2000 bytes" in payload["error"]["message"]

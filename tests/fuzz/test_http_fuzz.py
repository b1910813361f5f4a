"""The HTTP API under fuzzing, against a real local cluster.

- schemathesis generates requests from the frontend's own ``GET /openapi.json`` (valid and
  invalid ones) and checks every answer: never a 5xx, only documented statuses, documented
  content types and bodies that fit the documented schemas.
- Hand-written malformed inputs the schema cannot describe: bad JSON, wrong types, huge
  numbers, NaN, deep nesting, lone surrogates, NUL bytes, invalid UTF-8, oversized and
  slow-loris bodies, wrong content types and methods. Each gets an OpenAI-style JSON 4xx.

Afterwards no process of the cluster has died, ``/health`` is ok and a chat completion still
works. ``--fuzz-examples`` sets the examples per operation and mode (``scripts/fuzz``).
"""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.e2e.conftest import Cluster, processes_of
from tests.fuzz.conftest import MAX_BODY

pytestmark = [
    pytest.mark.fuzz,
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.nats,
    pytest.mark.redis,
]

# Generations are capped this short: the fuzzer is after the HTTP layer, not the model.
MAX_TOKENS = 3
TIMEOUT_S = 60
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
OPERATIONS = [
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "GET /v1/models",
    "GET /v1/models/{model}",
    "POST /v1/files",
    "GET /v1/files",
    "GET /v1/files/{file_id}",
    "DELETE /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content",
    "POST /v1/fine_tuning/jobs",
    "GET /v1/fine_tuning/jobs",
    "GET /v1/fine_tuning/jobs/{job_id}",
    "POST /v1/fine_tuning/jobs/{job_id}/cancel",
    "GET /v1/fine_tuning/jobs/{job_id}/events",
    "GET /v1/fine_tuning/jobs/{job_id}/checkpoints",
    "GET /health",
    "GET /metrics",
]
MSGS = [{"role": "user", "content": "Tell me about the license."}]


# --- the cluster ---------------------------------------------------------------------------


def _root(c: Cluster) -> str:
    return c.url.removesuffix("/v1")


def _chat(c: Cluster, **fields: Any) -> requests.Response:
    body = {"model": "demo", "messages": MSGS, "max_tokens": MAX_TOKENS, **fields}
    return requests.post(f"{c.url}/chat/completions", json=body, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def cluster(fuzz_cluster: Cluster) -> Iterator[Cluster]:
    """The fuzz cluster, warmed up (the demo model loaded), whose processes must all still be
    alive after every test of this module."""
    r = _chat(fuzz_cluster)
    assert r.status_code == 200, r.text
    before = set(processes_of(fuzz_cluster.name))
    assert before
    yield fuzz_cluster
    _assert_healthy(fuzz_cluster, before)


def _assert_healthy(c: Cluster, before: set[int]) -> None:
    gone = before - set(processes_of(c.name))
    assert not gone, f"processes of the cluster died: {sorted(gone)}"
    health = requests.get(f"{_root(c)}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = _chat(c, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.fixture(scope="module")
def pids(cluster: Cluster) -> set[int]:
    return set(processes_of(cluster.name))


# --- schemathesis --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api_schema(cluster: Cluster) -> Any:
    schema = schemathesis.openapi.from_url(f"{_root(cluster)}/openapi.json", timeout=10)
    # This cluster runs the open local default (no keys), so a request without the bearer key
    # the document declares is served: generate no Authorization headers, valid or not.
    schema.config.generation.update(with_security_parameters=False)
    return schema


def test_openapi_json(cluster: Cluster) -> None:
    r = requests.get(f"{_root(cluster)}/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1")
    assert {f"{m.upper()} {p}" for p, item in doc["paths"].items() for m in item} == set(OPERATIONS)


# Fields whose ranges the document does not state (validation checks them): the requests
# steered to the served model leave them out, so that most of those reach a TE.
UNSTATED = (
    "temperature",
    "top_p",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "tools",
    "response_format",
    "min_tokens",
    "echo",
    "suffix",
    "best_of",
    "stream_options",
)


def _integral(v: Any) -> Any:
    """JSON Schema counts 2.0 as an integer; the frontend decodes strictly and takes only 2
    (a float is a float). Integral floats go out as ints, which float fields take too."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        return int(v)
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


def _tame(case: Any, *, valid: bool, draw: Any) -> None:
    """Short generations (every int max_tokens capped, a missing or null one set) and, for
    valid requests, often the served model with valid roles, text parts and no out-of-range
    knobs, so that requests reach a TE rather than stopping at a 404 or 400."""
    steer = valid and draw(st.booleans())
    if steer and case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = "demo"
    body = case.body
    if not isinstance(body, dict):
        return
    body.update(_integral(body))
    for key in ("max_tokens", "max_completion_tokens"):
        v = body.get(key)
        too_long = isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS
        if too_long or (key == "max_tokens" and v is None):
            body[key] = MAX_TOKENS
    if not steer:
        return
    body["model"] = "demo"
    for key in UNSTATED:
        body.pop(key, None)
    if isinstance(body.get("prompt"), list):
        body["prompt"] = draw(st.sampled_from(["", "Tell me", [1, 2, 3]]))
    messages = body.get("messages")
    if isinstance(messages, list) and not messages:
        messages.append({"role": "user", "content": "hi"})
    for m in messages or []:
        m["role"] = draw(st.sampled_from(["system", "user", "assistant"]))
        if m.get("content") is None:
            m["content"] = ""
        if isinstance(m["content"], list):
            for part in m["content"]:
                part["type"] = "text"
                part["text"] = part.get("text") or ""


# Invalid requests exist only where there is a body to violate: the GET routes take no
# parameter but an id, and any string is one (a cancel is a POST without a body).
BODILESS = {"POST /v1/fine_tuning/jobs/{job_id}/cancel"}
FUZZED = [
    (op, mode)
    for op in OPERATIONS
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode == GenerationMode.POSITIVE or (op.startswith("POST") and op not in BODILESS)
]


@pytest.mark.parametrize(("operation", "mode"), FUZZED, ids=[f"{o}-{m.value}" for o, m in FUZZED])
def test_schemathesis(
    cluster: Cluster, pids: set[int], api_schema: Any, operation: str, mode: Any, fuzz_examples: int
) -> None:
    method, path = operation.split(" ")
    op = api_schema[path][method]
    valid = mode == GenerationMode.POSITIVE
    checks = CHECKS if valid else [*CHECKS, negative_data_rejection]
    session = requests.Session()

    @settings(
        max_examples=fuzz_examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=mode), data=st.data())
    def run(case: Any, data: Any) -> None:
        _tame(case, valid=valid, draw=data.draw)
        r = case.call_and_validate(
            base_url=_root(cluster), session=session, checks=checks, timeout=TIMEOUT_S
        )
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    statuses: dict[int, int] = {}
    run()
    print(operation, mode.value, "statuses:", dict(sorted(statuses.items())))
    gone = pids - set(processes_of(cluster.name))
    assert not gone, f"processes of the cluster died: {sorted(gone)}"


# --- hand-written malformed inputs ---------------------------------------------------------


def _send(
    port: int,
    head: bytes,
    body: bytes = b"",
    *,
    chunk: int = 1 << 16,
) -> tuple[int, dict[str, str], bytes]:
    """Send a raw request (``head`` ends with the blank line) and read the answer. The body
    goes out from a thread: a server that answers early (413) must not deadlock the test."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)

    def write() -> None:
        try:
            sock.sendall(head)
            for i in range(0, len(body), chunk):
                sock.sendall(body[i : i + chunk])
        except OSError:
            pass  # the server answered and closed before reading it all

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        sock.close()
        writer.join(5)


def _request(
    port: int,
    method: str,
    path: str,
    body: bytes = b"",
    *,
    content_type: str | None = "application/json",
    headers: dict[str, str] | None = None,
    chunked: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    if content_type is not None:
        lines.append(f"Content-Type: {content_type}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
        body = b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 65536]), body[i : i + 65536])
            for i in range(0, len(body), 65536)
        )
        body += b"0\r\n\r\n"
    elif body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return _send(port, head, body)


def _assert_openai_error(status: int, headers: dict[str, str], data: bytes, expect: int) -> dict:
    assert status == expect, (status, data[:500])
    assert headers["content-type"].startswith("application/json"), headers
    err = json.loads(data)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    return err


def _deep(open_: bytes, close: bytes, n: int = 100_000, inner: bytes = b"") -> bytes:
    return open_ * n + inner + close * n


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


def _chat_body(**extra: Any) -> dict:
    return {"model": "demo", "messages": MSGS, "max_tokens": MAX_TOKENS, **extra}


def _raw_chat(fields: bytes) -> bytes:
    """A chat body with ``fields`` (raw JSON, starting with a comma) added."""
    return b'{"model": "demo", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]' + (
        fields + b"}"
    )


# (name, path, body, expected status): every one must get that status as an OpenAI error.
REJECTED: list[tuple[str, str, bytes, int]] = [
    # Bad JSON and wrong shapes.
    ("empty", CHAT, b"", 400),
    ("truncated", CHAT, b'{"model": "demo", "messages": [', 400),
    ("not-json", COMP, b"model=demo&prompt=hi", 400),
    ("trailing-comma", CHAT, b'{"model": "demo",}', 400),
    ("single-quotes", CHAT, b"{'model': 'demo'}", 400),
    ("null", CHAT, b"null", 400),
    ("array", COMP, b"[]", 400),
    ("string", COMP, b'"prompt"', 400),
    ("two-objects", CHAT, b"{}{}", 400),
    ("bom", CHAT, b"\xef\xbb\xbf" + json.dumps(_chat_body()).encode(), 400),
    # Wrong types.
    ("model-int", CHAT, json.dumps({"model": 1, "messages": MSGS}).encode(), 400),
    ("messages-str", CHAT, json.dumps({"model": "demo", "messages": "hi"}).encode(), 400),
    ("messages-ints", CHAT, json.dumps({"model": "demo", "messages": [1]}).encode(), 400),
    ("max-tokens-str", CHAT, json.dumps(_chat_body(max_tokens="5")).encode(), 400),
    ("max-tokens-float", CHAT, json.dumps(_chat_body(max_tokens=1.5)).encode(), 400),
    ("temperature-str", CHAT, json.dumps(_chat_body(temperature="hot")).encode(), 400),
    ("stream-str", CHAT, json.dumps(_chat_body(stream="yes")).encode(), 400),
    ("stop-int", CHAT, json.dumps(_chat_body(stop=5)).encode(), 400),
    (
        "content-int",
        CHAT,
        json.dumps({"model": "demo", "messages": [{"role": "user", "content": 5}]}).encode(),
        400,
    ),
    ("prompt-object", COMP, json.dumps({"model": "demo", "prompt": {}}).encode(), 400),
    ("prompt-mixed", COMP, json.dumps({"model": "demo", "prompt": [1, "a"]}).encode(), 400),
    ("prompt-empty-ids", COMP, json.dumps({"model": "demo", "prompt": [[]]}).encode(), 400),
    ("prompt-negative-id", COMP, json.dumps({"model": "demo", "prompt": [-1]}).encode(), 400),
    ("prompt-id-past-vocab", COMP, json.dumps({"model": "demo", "prompt": [10**9]}).encode(), 400),
    # Huge numbers.
    ("max-tokens-1e400", CHAT, _raw_chat(b', "max_tokens": 1e400'), 400),
    ("max-tokens-2**70", CHAT, json.dumps(_chat_body(max_tokens=2**70)).encode(), 400),
    ("max-tokens--2**70", CHAT, json.dumps(_chat_body(max_tokens=-(2**70))).encode(), 400),
    (
        "completion-max-tokens-2**70",
        COMP,
        json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 2**70}).encode(),
        400,
    ),
    ("seed-2**70", CHAT, json.dumps(_chat_body(seed=2**70)).encode(), 400),
    (
        "seed-2**64",
        COMP,
        json.dumps({"model": "demo", "prompt": "hi", "seed": 2**64}).encode(),
        400,
    ),
    ("seed--2**70", CHAT, json.dumps(_chat_body(seed=-(2**70))).encode(), 400),
    ("temperature-1e400", CHAT, _raw_chat(b', "temperature": 1e400'), 400),
    ("top-p-1e-400", CHAT, _raw_chat(b', "top_p": 1e-400'), 400),
    ("n-2**70", CHAT, json.dumps(_chat_body(n=2**70)).encode(), 400),
    ("prompt-id-2**70", COMP, json.dumps({"model": "demo", "prompt": [2**70]}).encode(), 400),
    ("digits", CHAT, _raw_chat(b', "seed": ' + b"9" * 100_000), 400),
    # NaN and Infinity literals.
    ("nan", CHAT, _raw_chat(b', "temperature": NaN'), 400),
    ("infinity", CHAT, _raw_chat(b', "top_p": Infinity'), 400),
    (
        "minus-infinity",
        COMP,
        b'{"model": "demo", "prompt": "hi", "presence_penalty": -Infinity}',
        400,
    ),
    # Deep nesting.
    ("deep-top-arrays", CHAT, _deep(b"[", b"]"), 400),
    ("deep-messages", CHAT, b'{"model": "demo", "messages": ' + _deep(b"[", b"]") + b"}", 400),
    ("deep-tools", CHAT, _raw_chat(b', "tools": ' + _deep(b"[", b"]")), 400),
    (
        "deep-tool-calls",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "assistant", "tool_calls": [{"f": '
        + _deep(b'{"a": ', b"}", inner=b"1")
        + b"}]}]}",
        400,
    ),
    (
        "deep-unknown-field",
        COMP,
        b'{"model": "demo", "prompt": "hi", "x": ' + _deep(b'{"a": ', b"}", inner=b"1") + b"}",
        400,
    ),
    (
        "deep-unknown-mixed",
        CHAT,
        _raw_chat(b', "metadata": ' + _deep(b'[{"a": ', b"}]", n=50_000, inner=b"1")),
        400,
    ),
    # Unicode edge cases.
    (
        "lone-high-surrogate",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "\\ud800"}]}',
        400,
    ),
    (
        "lone-low-surrogate",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "\\udc00"}]}',
        400,
    ),
    ("high-surrogate-then-letter", COMP, b'{"model": "demo", "prompt": "\\ud800\\u0041"}', 400),
    ("surrogate-model", COMP, b'{"model": "\\udfff", "prompt": "hi"}', 400),
    (
        "raw-nul-in-string",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "a\x00b"}]}',
        400,
    ),
    ("raw-nul-outside", CHAT, b"{\x00}", 400),
    (
        "invalid-utf8",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "\xff\xfe"}]}',
        400,
    ),
    ("overlong-utf8", COMP, b'{"model": "demo", "prompt": "\xc0\xaf"}', 400),
    ("cesu-surrogate-utf8", COMP, b'{"model": "demo", "prompt": "\xed\xa0\x80"}', 400),
    (
        "truncated-utf8",
        CHAT,
        b'{"model": "demo", "messages": [{"role": "user", "content": "\xe2\x82"}]}',
        400,
    ),
    ("invalid-utf8-model", CHAT, b'{"model": "\xff", "messages": []}', 400),
    (
        "unknown-unicode-model",
        CHAT,
        json.dumps({"model": "\U0001f999\u202e\u0000", "messages": MSGS}).encode(),
        404,
    ),
    # Sizes: a 5 MB prompt under the body limit (too long for the context), 10 MB over it.
    ("5mb-prompt", COMP, json.dumps({"model": "demo", "prompt": "x" * 5_000_000}).encode(), 400),
    ("10mb-body", CHAT, json.dumps(_chat_body(user="x" * 10_000_000)).encode(), 413),
]


@pytest.mark.parametrize(
    ("path", "body", "status"), [r[1:] for r in REJECTED], ids=[r[0] for r in REJECTED]
)
def test_malformed_body(
    cluster: Cluster, pids: set[int], path: str, body: bytes, status: int
) -> None:
    _assert_openai_error(*_request(cluster.port, "POST", path, body), status)


# Odd but valid: served (or refused with a 4xx), never a 5xx.
ODD: list[tuple[str, str, dict]] = [
    ("escaped-nul", CHAT, _chat_body(messages=[{"role": "user", "content": "a\u0000b"}])),
    ("nul-prompt", COMP, {"model": "demo", "prompt": "\u0000", "max_tokens": 3}),
    ("noncharacters", COMP, {"model": "demo", "prompt": "\uffff\ufffe\U0010ffff", "max_tokens": 3}),
    (
        "emoji-zwj",
        CHAT,
        _chat_body(messages=[{"role": "user", "content": "\U0001f469\u200d\U0001f4bb" * 20}]),
    ),
    (
        "rtl-combining",
        CHAT,
        _chat_body(messages=[{"role": "user", "content": "\u202eab\u0301\u0301\u0301"}]),
    ),
    (
        "control-chars",
        COMP,
        {"model": "demo", "prompt": "".join(map(chr, range(32))), "max_tokens": 3},
    ),
    ("empty-content", CHAT, _chat_body(messages=[{"role": "user", "content": ""}])),
    ("empty-prompt", COMP, {"model": "demo", "prompt": "", "max_tokens": 3}),
    ("seed-int64-min", CHAT, _chat_body(seed=-(2**63), temperature=1.0)),
    ("seed-int64-max", COMP, {"model": "demo", "prompt": "hi", "seed": 2**63 - 1, "max_tokens": 3}),
    ("tiny-temperature", CHAT, _chat_body(temperature=5e-324)),
    ("tiny-top-p", CHAT, _chat_body(top_p=5e-324, temperature=1.0)),
    ("max-float-penalty", CHAT, _chat_body(presence_penalty=-0.0)),
    ("stream-tiny", COMP, {"model": "demo", "prompt": "hi", "max_tokens": 1, "stream": True}),
    ("stop-unicode", CHAT, _chat_body(stop=["\U0001f999", "\u0000", ""])),
    ("token-ids", COMP, {"model": "demo", "prompt": [0, 1, 2], "max_tokens": 3}),
    ("many-messages", CHAT, _chat_body(messages=[{"role": "user", "content": "a"}] * 2000)),
]


@pytest.mark.parametrize(("path", "body"), [r[1:] for r in ODD], ids=[r[0] for r in ODD])
def test_odd_but_valid_body(cluster: Cluster, pids: set[int], path: str, body: dict) -> None:
    raw = json.dumps(body).encode()
    status, headers, data = _request(cluster.port, "POST", path, raw)
    assert status < 500, (status, data[:500])
    if status == 200:
        kind = headers["content-type"]
        assert kind.startswith("text/event-stream" if body.get("stream") else "application/json")
        if not body.get("stream"):
            assert json.loads(data)["usage"]["completion_tokens"] <= MAX_TOKENS
    else:
        _assert_openai_error(status, headers, data, status)
        assert 400 <= status < 500


def test_oversized_chunked_body_is_413(cluster: Cluster, pids: set[int]) -> None:
    body = json.dumps(_chat_body(user="x" * 10_000_000)).encode()
    _assert_openai_error(*_request(cluster.port, "POST", CHAT, body, chunked=True), 413)


@pytest.mark.parametrize(
    ("content_type", "body"),
    [
        ("text/plain", b"hello"),
        ("application/x-www-form-urlencoded", b"model=demo&prompt=hi"),
        (
            "multipart/form-data; boundary=x",
            b'--x\r\nContent-Disposition: form-data; name="model"\r\n\r\ndemo\r\n--x--\r\n',
        ),
        ("application/xml", b"<model>demo</model>"),
        (None, b"\x00\x01\x02"),
    ],
)
def test_wrong_content_type(
    cluster: Cluster, pids: set[int], content_type: str | None, body: bytes
) -> None:
    for path in (CHAT, COMP):
        got = _request(cluster.port, "POST", path, body, content_type=content_type)
        _assert_openai_error(*got, 400)


def test_json_under_another_content_type_is_served(cluster: Cluster, pids: set[int]) -> None:
    # As `curl -d` sends it: the body is read as JSON whatever the declared type.
    raw = json.dumps(_chat_body()).encode()
    status, _, data = _request(
        cluster.port, "POST", CHAT, raw, content_type="application/x-www-form-urlencoded"
    )
    assert status == 200, data[:500]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", CHAT, 405),
        ("GET", COMP, 405),
        ("PUT", CHAT, 405),
        ("DELETE", COMP, 405),
        ("PATCH", "/v1/models", 405),
        ("POST", "/v1/models", 405),
        ("POST", "/v1/models/demo", 405),
        ("POST", "/health", 405),
        ("DELETE", "/openapi.json", 405),
        ("GET", "/v1/nothing", 404),
        ("POST", "/v2/chat/completions", 404),
        ("GET", "/v1/models/%FF%FE", 404),
        ("GET", "/v1/models/%ED%A0%80", 404),
        ("GET", "/v1/models/%00", 404),
        ("GET", "/v1/models/" + "x" * 4000, 404),
    ],
)
def test_wrong_method_or_route(
    cluster: Cluster, pids: set[int], method: str, path: str, status: int
) -> None:
    status_, headers, data = _request(cluster.port, method, path, b"")
    _assert_openai_error(status_, headers, data, status)
    if status == 405:
        assert headers["allow"]


def test_content_encoding(cluster: Cluster, pids: set[int]) -> None:
    gz = {"Content-Encoding": "gzip"}
    port = cluster.port
    # Not gzip at all: the body cannot be read.
    _assert_openai_error(*_request(port, "POST", CHAT, b"{}", headers=gz), 400)
    # A gzip bomb: counted decompressed against the body limit.
    bomb = gzip.compress(b" " * (MAX_BODY + 1))
    _assert_openai_error(*_request(port, "POST", COMP, bomb, headers=gz), 413)
    status, _, data = _request(
        port, "POST", CHAT, gzip.compress(json.dumps(_chat_body()).encode()), headers=gz
    )
    assert status == 200, data[:500]


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"GET /health HTTP/1.1\r\nX-A: a\x00b\r\n\r\n",
        b"GET /health HTTP/1.1\r\nX-A: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET /v1/models/\xff\xfe HTTP/1.1\r\n\r\n",
        b"G\x00T /health HTTP/1.1\r\n\r\n",
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
    ],
    ids=[
        "bad-length",
        "huge-length",
        "length-and-chunked",
        "bad-chunk",
        "nul-header",
        "huge-header",
        "utf8-path",
        "nul-method",
        "tls",
    ],
)
def test_malformed_http(cluster: Cluster, pids: set[int], head: bytes) -> None:
    """Requests the HTTP parser itself refuses (before the API sees them): a 4xx, whatever
    its body."""
    status, _, data = _send(cluster.port, head)
    assert 400 <= status < 500, (status, data[:300])


def test_slow_loris_does_not_block_others(cluster: Cluster, pids: set[int]) -> None:
    """Clients that stall mid-headers, mid-body or drip their body byte by byte hold only their
    own connection: a normal request meanwhile is served at once, and the dripped body still
    gets its answer."""
    port = cluster.port
    body = json.dumps(_chat_body()).encode()
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    stalled = []
    for partial in (head[:20], head, head + body[:10], head + body[:-1]):
        s = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)
        s.sendall(partial)
        stalled.append(s)
    drip_result: list[tuple[int, dict[str, str], bytes]] = []
    dripper = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S)

    def drip() -> None:
        dripper.sendall(head)
        for b in body:  # the whole body, one byte every 20 ms
            dripper.sendall(bytes([b]))
            time.sleep(0.02)
        resp = http.client.HTTPResponse(dripper)
        resp.begin()
        drip_result.append((resp.status, dict(resp.getheaders()), resp.read()))

    t = threading.Thread(target=drip, daemon=True)
    t.start()
    try:
        time.sleep(0.5)
        for _ in range(3):
            t0 = time.monotonic()
            r = _chat(cluster, temperature=0)
            assert r.status_code == 200, r.text
            assert time.monotonic() - t0 < 20
        t.join(TIMEOUT_S)
        assert drip_result and drip_result[0][0] == 200, drip_result
    finally:
        for s in [*stalled, dripper]:
            s.close()


def test_cluster_survived(cluster: Cluster, pids: set[int]) -> None:
    _assert_healthy(cluster, pids)

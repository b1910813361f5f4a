"""The frontend's OpenAPI document and the HTTP layer's answers that need no cluster: the
document matches the routes and the msgspec request types, and malformed requests, wrong
methods and oversized bodies get OpenAI-style 4xx errors."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import msgspec
import pytest
import schemathesis
from aiohttp.test_utils import TestClient, TestServer

from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest
from services.frontend.openapi import document
from services.frontend.service import Frontend
from shared.settings import Settings


def _refs(node):
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def test_document_is_openapi_31_with_every_route():
    doc = document(1024)
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/files",
        "/v1/files/{file_id}",
        "/v1/files/{file_id}/content",
        "/v1/fine_tuning/jobs",
        "/v1/fine_tuning/jobs/{job_id}",
        "/v1/fine_tuning/jobs/{job_id}/cancel",
        "/v1/fine_tuning/jobs/{job_id}/events",
        "/v1/fine_tuning/jobs/{job_id}/checkpoints",
        "/health",
        "/metrics",
    }
    schemas = doc["components"]["schemas"]
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas
    assert doc["components"]["securitySchemes"] == {"bearer": {"type": "http", "scheme": "bearer"}}
    json.dumps(doc)  # plain JSON


def test_request_bodies_are_the_msgspec_types():
    doc = document()
    _, expected = msgspec.json.schema_components(
        (ChatCompletionRequest, CompletionRequest), ref_template="#/components/schemas/{name}"
    )
    for name, schema in expected.items():
        assert doc["components"]["schemas"][name] == schema
    seed = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["seed"]
    assert {"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1} in seed["anyOf"]


def test_v1_routes_need_a_bearer_key_and_document_the_errors():
    doc = document()
    for path, item in doc["paths"].items():
        for op in item.values():
            if path.startswith("/v1/"):
                assert op["security"] == [{"bearer": []}]
                assert "401" in op["responses"]
            else:
                assert op["security"] == []
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "429", "503"} <= set(responses)
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        assert "Retry-After" in responses["503"]["headers"]
        assert responses["400"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"
        }


def test_schemathesis_loads_the_document():
    schema = schemathesis.openapi.from_dict(document())
    labels = {r.ok().label for r in schema.get_all_operations()}
    assert "POST /v1/chat/completions" in labels and "GET /v1/models/{model}" in labels


@pytest.fixture
async def http():
    settings = Settings.load({}, frontend={"max_body_bytes": 1024**2})
    # No bus: these requests never get past the HTTP layer.
    bus = SimpleNamespace(on_disconnected=[], on_reconnected=[])
    app = Frontend(settings=settings, bus=bus).app()  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        yield client


async def _error(resp, status: int) -> dict:
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    body = await resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


async def test_openapi_json_is_served(http):
    resp = await http.get("/openapi.json")
    assert resp.status == 200 and resp.content_type == "application/json"
    assert (await resp.json())["openapi"] == "3.1.0"


async def test_wrong_method_is_405_with_allow(http):
    resp = await http.get("/v1/chat/completions")
    await _error(resp, 405)
    assert resp.headers["Allow"] == "POST"
    resp = await http.post("/v1/models")
    await _error(resp, 405)
    assert "GET" in resp.headers["Allow"]


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "\xc0\xaf", "messages": [{"role": "user", "content": "\xff"}]}',
        b'{"model": "m", "messages": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "m", "messages": [], "tools": ['
        + b'{"a":' * 100_000
        + b"1"
        + b"}" * 100_000
        + b"]}",
    ],
    ids=["invalid-utf8", "deep-arrays", "deep-objects"],
)
async def test_undecodable_bodies_are_400(http, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        err = await _error(await http.post(path, data=raw), 400)
        assert "could not parse the JSON body" in err["message"]


async def test_body_over_the_limit_is_413(http):
    await _error(await http.post("/v1/chat/completions", data=b" " * (1024**2 + 1)), 413)


async def test_body_in_a_content_encoding_it_is_not_in_is_400(http):
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    resp = await http.post("/v1/completions", data=b'{"model": "m"}', headers=headers)
    err = await _error(resp, 400)
    assert "could not be read" in err["message"] and "gzip" in err["message"]


async def test_gzip_body_is_decoded_and_a_gzip_bomb_is_413(http):
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    raw = gzip.compress(b'{"model": "m", "prompt": "hi", "n": 2}')
    err = await _error(await http.post("/v1/completions", data=raw, headers=headers), 400)
    assert err["param"] == "n"  # decoded and validated
    bomb = gzip.compress(b" " * (8 * 1024**2))
    await _error(await http.post("/v1/completions", data=bomb, headers=headers), 413)

"""The frontend's protocol layer: request validation, response shapes, stop strings."""

from __future__ import annotations

import json
import random

import msgspec
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.frontend import responses as r
from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest
from services.frontend.stop import StopMatcher
from services.frontend.validation import (
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)
from shared.errors import BadRequest

try:  # openai 3.x ships its HTTP stack as httpx2; older releases use httpx
    import httpx2 as httpx
except ImportError:
    import httpx


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields) -> bytes:
    fields.setdefault("model", "m")
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return body(**fields)


def comp(**fields) -> bytes:
    fields.setdefault("model", "m")
    fields.setdefault("prompt", "hi")
    return body(**fields)


def bad(fn, raw: bytes) -> BadRequest:
    with pytest.raises(BadRequest) as exc:
        fn(raw)
    err = exc.value
    assert err.status == 400
    payload = err.to_openai()["error"]
    assert payload["type"] == "invalid_request_error"
    assert payload["message"]
    return err


# --- parsing -------------------------------------------------------------------------------


def test_chat_minimal_request_defaults():
    req = parse_chat_request(chat())
    assert req.model == "m"
    assert req.template_messages() == [{"role": "user", "content": "hi"}]
    assert not req.is_stream and not req.include_usage
    assert req.max_output_tokens is None
    assert req.stop_strings == []


def test_chat_every_content_shape_and_role():
    req = parse_chat_request(
        chat(
            messages=[
                {"role": "system", "content": "sys"},
                {"role": "developer", "content": [{"type": "text", "text": "dev"}]},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                    "name": "alice",
                },
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"},
                {"role": "user", "content": []},
            ]
        )
    )
    assert req.template_messages() == [
        {"role": "system", "content": "sys"},
        {"role": "developer", "content": "dev"},
        {"role": "user", "content": "a\nb", "name": "alice"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": ""},
    ]


def test_chat_unknown_fields_are_ignored_and_options_parsed():
    req = parse_chat_request(
        chat(
            metadata={"x": "y"},
            service_tier="auto",
            max_tokens=5,
            max_completion_tokens=7,
            temperature=0,
            top_p=1,
            seed=-3,
            stop="\n",
            n=1,
            stream=True,
            stream_options={"include_usage": True, "include_obfuscation": False},
            user="u",
            presence_penalty=0.5,
            frequency_penalty=-1,
            ignore_eos=True,
            min_tokens=0,
            logprobs=False,
            top_logprobs=0,
            response_format={"type": "text"},
            tools=[],
        )
    )
    assert req.max_output_tokens == 7  # max_completion_tokens wins
    assert req.temperature == 0.0 and req.seed == -3
    assert req.is_stream and req.include_usage
    assert req.stop_strings == ["\n"]
    assert req.ignore_eos


def test_chat_request_from_the_openai_client_serialization():
    # What openai.chat.completions.create(...) puts on the wire for a typical call.
    raw = (
        b'{"messages":[{"role":"system","content":"You are terse."},'
        b'{"role":"user","content":[{"type":"text","text":"Hi"}]}],'
        b'"model":"qwen","max_completion_tokens":16,"stop":["END","\\n\\n"],'
        b'"stream":true,"stream_options":{"include_usage":true},"temperature":0.7}'
    )
    req = parse_chat_request(raw)
    assert req.max_output_tokens == 16
    assert req.stop_strings == ["END", "\n\n"]
    assert req.template_messages()[1] == {"role": "user", "content": "Hi"}


def test_stop_empty_strings_are_dropped():
    assert parse_chat_request(chat(stop=["", "x"])).stop_strings == ["x"]
    assert parse_chat_request(chat(stop="")).stop_strings == []


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", "hello"),
        (["hello"], "hello"),
        ([1, 2, 3], [1, 2, 3]),
        ([[4, 5]], [4, 5]),
        ("", ""),
    ],
)
def test_completion_prompt_shapes(prompt, expected):
    req = parse_completion_request(comp(prompt=prompt))
    assert req.prompt_input() == expected


def test_completion_defaults_follow_openai():
    req = parse_completion_request(comp())
    assert req.max_output_tokens == 16
    assert parse_completion_request(comp(max_tokens=None)).max_output_tokens is None
    assert parse_completion_request(comp(echo=False, best_of=1, suffix="")).model == "m"


# --- validation errors ---------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b'{"model": "m",}', b"\xff\xfe"])
def test_malformed_json(raw):
    for fn in (parse_chat_request, parse_completion_request):
        err = bad(fn, raw)
        assert "could not parse the JSON body" in err.message
        assert err.param is None


DEEP = 100_000


@pytest.mark.parametrize(
    "raw",
    [
        # Invalid UTF-8 inside a string: msgspec raises UnicodeDecodeError, not DecodeError.
        b'{"model": "m", "prompt": "\xc0\xaf", "messages": [{"role": "user", "content": "\xff"}]}',
        # Nesting past Python's recursion limit: in a typed field, an untyped one, an unknown one.
        b'{"model": "m", "messages": [{"role": "user", "tool_calls": [{"a": '
        + b"[" * DEEP
        + b"]" * DEEP
        + b"}]}]}",
        b'{"model": "m", "messages": [], "tools": [' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"]}",
        b'{"model": "m", "prompt": "x", "extra": ' + b"[" * DEEP + b"]" * DEEP + b"}",
        # Lone surrogates in escapes, NaN and Infinity literals: not JSON.
        b'{"model": "\\ud800", "prompt": "\\udc00"}',
        b'{"model": "m", "prompt": "x", "temperature": NaN}',
        b'{"model": "m", "prompt": "x", "temperature": -Infinity}',
    ],
    ids=["utf8", "deep-typed", "deep-any", "deep-unknown", "surrogate", "nan", "inf"],
)
def test_undecodable_bodies_are_400_not_a_crash(raw):
    for fn in (parse_chat_request, parse_completion_request):
        err = bad(fn, raw)
        assert "could not parse the JSON body" in err.message, err.message


@pytest.mark.parametrize(
    ("seed", "ok"), [(2**63 - 1, True), (-(2**63), True), (2**63, False), (2**70, False)]
)
def test_seed_is_a_64_bit_integer(seed, ok):
    for fn, raw in (
        (parse_chat_request, chat(seed=seed)),
        (parse_completion_request, comp(seed=seed)),
    ):
        if ok:
            assert fn(raw).seed == seed
        else:
            assert bad(fn, raw).param == "seed"


def test_huge_numbers_are_400():
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}'
    assert bad(parse_chat_request, raw).param == "temperature"
    # Past the context limit whatever the prompt: the 400 comes from sampling_params.
    req = parse_chat_request(chat(max_tokens=2**70))
    with pytest.raises(BadRequest, match="maximum context length"):
        sampling_params(req, prompt_tokens=3, max_context=64, eos_token_ids=[0])


def test_body_must_be_an_object():
    err = bad(parse_chat_request, b"[1, 2]")
    assert err.param is None
    assert "JSON object" in err.message


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (body(messages=[{"role": "user", "content": "x"}]), "model", "Missing required"),
        (body(model="m"), "messages", "Missing required"),
        (chat(model=3), "model", "Expected `str`"),
        (chat(messages="hi"), "messages", "Expected `array`"),
        (chat(messages=[{"content": "x"}]), "messages[0].role", "Missing required"),
        (chat(messages=[{"role": 1, "content": "x"}]), "messages[0].role", "Expected `str`"),
        (chat(messages=[{"role": "user", "content": 5}]), "messages[0].content", "Expected"),
        (
            chat(messages=[{"role": "user", "content": [{"text": "x"}]}]),
            "messages[0].content[0].type",
            "Missing required",
        ),
        (chat(temperature="hot"), "temperature", "Expected `float | null`"),
        (chat(max_tokens=1.5), "max_tokens", "Expected `int | null`"),
        (chat(stream="yes"), "stream", "Expected `bool | null`"),
        (chat(stop=[1]), "stop[0]", "Expected `str`"),
        (
            chat(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage",
            "Expected",
        ),
    ],
)
def test_chat_type_errors_name_the_field(raw, param, fragment):
    err = bad(parse_chat_request, raw)
    assert err.param == param
    assert fragment in err.message
    assert param in err.message


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"messages": []}, "messages", "at least one"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'robot'"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "function"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "Missing"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "Missing"),
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "look"},
                            {"type": "image_url", "image_url": {"url": "http://x"}},
                        ],
                    },
                ]
            },
            "messages[1].content[1].type",
            "only text content is supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
            "Missing",
        ),
        ({"temperature": 2.5}, "temperature", "between 0 and 2"),
        ({"temperature": -0.1}, "temperature", "between 0 and 2"),
        ({"top_p": 0}, "top_p", "greater than 0"),
        ({"top_p": 1.01}, "top_p", "at most 1"),
        ({"presence_penalty": 3}, "presence_penalty", "between -2 and 2"),
        ({"frequency_penalty": -2.5}, "frequency_penalty", "between -2 and 2"),
        ({"n": 2}, "n", "n=1"),
        ({"n": 0}, "n", "n=1"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "At most 4"),
        ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
        ({"stream": False, "stream_options": {}}, "stream_options", "only allowed"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_completion_tokens": -1}, "max_completion_tokens", "at least 1"),
        ({"logprobs": True}, "logprobs", "not supported"),
        ({"top_logprobs": 3}, "top_logprobs", "not supported"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
        ({"min_tokens": 3}, "min_tokens", "not supported"),
        ({"min_tokens": -1}, "min_tokens", "at least 0"),
    ],
)
def test_chat_semantic_errors(fields, param, fragment):
    err = bad(parse_chat_request, chat(**fields))
    assert err.param == param
    assert fragment in err.message


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({"prompt": None}, "prompt", "Expected"),
        ({"prompt": 5}, "prompt", "Expected"),
        ({"prompt": []}, "prompt", "must not be empty"),
        ({"prompt": ["a", "b"]}, "prompt", "single prompt"),
        ({"prompt": [[1], [2]]}, "prompt", "single prompt"),
        ({"prompt": [[]]}, "prompt[0]", "must not be empty"),
        ({"prompt": [1, "a"]}, "prompt[1]", "list of integers"),
        ({"prompt": [1, [2]]}, "prompt[1]", "list of integers"),
        ({"prompt": [1, -2]}, "prompt[1]", "negative"),
        ({"prompt": [[1, -2]]}, "prompt[0][1]", "negative"),
        ({"prompt": [1.5]}, "prompt[0]", "Expected"),
        ({"prompt": [True]}, "prompt[0]", "Expected"),
        ({"prompt": [[1, "a"]]}, "prompt[0][1]", "Expected `int`"),
        ({"echo": True}, "echo", "not supported"),
        ({"logprobs": 0}, "logprobs", "not supported"),
        ({"suffix": "end"}, "suffix", "not supported"),
        ({"best_of": 2}, "best_of", "best_of=1"),
        ({"n": 3}, "n", "n=1"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"temperature": 9}, "temperature", "between 0 and 2"),
        ({"stop": ["1", "2", "3", "4", "5"]}, "stop", "At most 4"),
    ],
)
def test_completion_errors(fields, param, fragment):
    err = bad(parse_completion_request, comp(**fields))
    assert err.param == param
    assert fragment in err.message


def test_missing_prompt():
    err = bad(parse_completion_request, body(model="m"))
    assert err.param == "prompt"


def test_error_body_is_openai_shaped():
    err = bad(parse_chat_request, chat(n=2))
    assert r.error_body(err) == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": "n",
            "code": "invalid_request",
        }
    }


# --- sampling params and the context limit -------------------------------------------------


def test_sampling_defaults_fill_the_context():
    req = parse_chat_request(chat())
    sp = sampling_params(req, prompt_tokens=100, max_context=4096, eos_token_ids=[2, 7])
    assert sp.max_tokens == 3996
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.seed is None
    assert sp.stop_token_ids == [2, 7] and not sp.ignore_eos


def test_sampling_explicit_values():
    req = parse_chat_request(
        chat(max_tokens=9, max_completion_tokens=10, temperature=0, top_p=0.5, seed=11)
    )
    sp = sampling_params(req, prompt_tokens=10, max_context=20, eos_token_ids=(2,))
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.seed) == (10, 0.0, 0.5, 11)


def test_ignore_eos_drops_eos_ids():
    req = parse_completion_request(comp(ignore_eos=True, max_tokens=4))
    sp = sampling_params(req, prompt_tokens=3, max_context=100, eos_token_ids=[2])
    assert sp.ignore_eos and sp.stop_token_ids == [] and sp.max_tokens == 4


def test_context_length_exceeded_wording():
    req = parse_chat_request(chat(max_tokens=100))
    with pytest.raises(BadRequest) as exc:
        sampling_params(req, prompt_tokens=4000, max_context=4096, eos_token_ids=[])
    err = exc.value
    assert err.message == (
        "This model's maximum context length is 4096 tokens. However, you requested 4100 "
        "tokens (4000 in the messages, 100 in the completion). Please reduce the length of "
        "the messages or completion."
    )
    assert (err.status, err.param, err.code) == (400, "messages", "context_length_exceeded")


def test_context_exactly_full_is_allowed():
    req = parse_chat_request(chat(max_tokens=96))
    assert (
        sampling_params(req, prompt_tokens=4000, max_context=4096, eos_token_ids=[]).max_tokens
        == 96
    )


def test_prompt_fills_context_without_max_tokens():
    req = parse_completion_request(comp(max_tokens=None))
    with pytest.raises(BadRequest) as exc:
        sampling_params(req, prompt_tokens=4096, max_context=4096, eos_token_ids=[])
    err = exc.value
    assert err.param == "prompt" and err.code == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in err.message
    assert "4096 tokens" in err.message


def test_completion_default_16_can_exceed_context():
    req = parse_completion_request(comp())
    with pytest.raises(BadRequest) as exc:
        sampling_params(req, prompt_tokens=90, max_context=100, eos_token_ids=[])
    assert "(90 in the prompt, 16 in the completion)" in exc.value.message
    assert exc.value.param == "prompt"


def test_empty_prompt_after_tokenization():
    req = parse_completion_request(comp(prompt=""))
    with pytest.raises(BadRequest) as exc:
        sampling_params(req, prompt_tokens=0, max_context=100, eos_token_ids=[])
    assert exc.value.param == "prompt"


# --- response shapes -----------------------------------------------------------------------


def decode_sse(frame: bytes) -> dict:
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    return json.loads(frame[6:-2])


def test_chat_completion_parses_with_openai_types():
    cid = r.chat_id()
    assert cid.startswith("chatcmpl-") and len(cid) > 20
    obj = r.chat_completion(cid, "m", 1700000000, "héllo", "stop", r.usage(5, 3, cached_tokens=2))
    parsed = ChatCompletion.model_validate(json.loads(r.json_body(obj)))
    assert parsed.id == cid and parsed.object == "chat.completion"
    assert parsed.choices[0].message.content == "héllo"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.choices[0].logprobs is None
    assert parsed.usage.total_tokens == 8
    assert parsed.usage.prompt_tokens_details.cached_tokens == 2


def test_chat_stream_parses_with_openai_types():
    cid = r.chat_id()
    frames = [
        r.sse(r.chat_chunk(cid, "m", 1, delta={"role": "assistant", "content": ""})),
        r.sse(r.chat_chunk(cid, "m", 1, delta={"content": "Hel"})),
        r.sse(r.chat_chunk(cid, "m", 1, delta={"content": "lo\n"})),
        r.sse(r.chat_chunk(cid, "m", 1, delta={}, finish_reason="length")),
        r.sse(r.usage_chunk(cid, "m", 1, r.usage(4, 2))),
    ]
    chunks = [ChatCompletionChunk.model_validate(decode_sse(f)) for f in frames]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "Hello\n"
    assert chunks[3].choices[0].finish_reason == "length"
    assert chunks[4].choices == [] and chunks[4].usage.completion_tokens == 2
    assert all(c.object == "chat.completion.chunk" and c.id == cid for c in chunks)
    assert r.SSE_DONE == b"data: [DONE]\n\n"


def test_completion_parses_with_openai_types():
    cid = r.completion_id()
    assert cid.startswith("cmpl-")
    obj = r.completion(cid, "m", 2, "text", "length", r.usage(1, 16))
    parsed = Completion.model_validate(json.loads(r.json_body(obj)))
    assert parsed.object == "text_completion"
    assert parsed.choices[0].text == "text" and parsed.choices[0].index == 0
    assert parsed.usage.total_tokens == 17


def test_completion_stream_parses_with_openai_types():
    cid = r.completion_id()
    mid = decode_sse(r.sse(r.completion_chunk(cid, "m", 3, text="ab")))
    # OpenAI sends null finish_reason mid-stream; the client builds chunks without
    # validation, while Completion's schema demands a value, so check the rest of it.
    assert mid["choices"][0]["finish_reason"] is None
    mid["choices"][0]["finish_reason"] = "stop"
    assert Completion.model_validate(mid).choices[0].text == "ab"
    last = decode_sse(r.sse(r.completion_chunk(cid, "m", 3, text="", finish_reason="stop")))
    assert Completion.model_validate(last).choices[0].finish_reason == "stop"
    tail = Completion.model_validate(
        decode_sse(r.sse(r.usage_chunk(cid, "m", 3, r.usage(2, 1), chat=False)))
    )
    assert tail.choices == [] and tail.usage.total_tokens == 3 and tail.object == "text_completion"


def test_sse_error_frame():
    err = BadRequest("nope", param="x")
    assert decode_sse(r.sse(r.error_body(err)))["error"]["param"] == "x"


def test_ids_are_unique():
    assert len({r.chat_id() for _ in range(100)}) == 100


# --- stop strings --------------------------------------------------------------------------


def run_matcher(stops, pieces) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, hit = m.push(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    out.append(m.flush())
    return "".join(out), False


def reference(stops, text) -> tuple[str, bool]:
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best):
            best = (i + len(s), i)
    return (text, False) if best is None else (text[: best[1]], True)


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text), 6))))
    pieces, prev = [], 0
    for c in [*cuts, len(text)]:
        pieces.append(text[prev:c])
        prev = c
    if rng.random() < 0.3:
        pieces.insert(rng.randint(0, len(pieces)), "")
    return pieces


def test_stop_across_boundaries():
    assert run_matcher(["END"], ["Hello E", "N", "D world"]) == ("Hello ", True)
    assert run_matcher(["END"], ["Hello EN", "d"]) == ("Hello ENd", False)
    assert run_matcher(["\n\n"], ["a\n", "\nb"]) == ("a", True)


def test_stop_holds_back_only_possible_prefixes():
    m = StopMatcher(["abc"])
    assert m.push("xxa") == ("xx", False)
    assert m.push("b") == ("", False)
    assert m.push("x") == ("abx", False)
    assert m.push("ab") == ("", False)
    assert m.flush() == "ab"


def test_stop_hit_is_final():
    m = StopMatcher(["x"])
    assert m.push("ax") == ("a", True)
    assert m.stopped and m.hit == "x"
    assert m.push("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_through():
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)
    assert StopMatcher([""]).push("abc") == ("abc", False)


def test_earliest_completing_stop_wins():
    # "c" completes before "abcd" could, which is what a streaming check must decide on.
    assert run_matcher(["abcd", "c"], ["abcd"]) == ("ab", True)
    assert run_matcher(["abcd", "c"], ["a", "b", "c", "d"]) == ("ab", True)
    # Same end: the longer one started earlier.
    assert run_matcher(["bc", "abc"], ["xabc"]) == ("x", True)


def test_stop_property_random_splits():
    rng = random.Random(1234)
    alphabet = "ab\n "
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
            for _ in range(rng.randint(0, 4))
        ]
        expected = reference(stops, text)
        for _ in range(3):
            assert run_matcher(stops, random_split(rng, text)) == expected, (stops, text)


def test_stop_unicode():
    assert run_matcher(["。"], ["你好", "。再见"]) == ("你好", True)


def test_request_structs_roundtrip_with_msgspec():
    # The lead may log or forward parsed requests; they must stay plain msgspec Structs.
    req = parse_chat_request(chat(stop=["x"]))
    assert isinstance(
        msgspec.json.decode(msgspec.json.encode(req), type=ChatCompletionRequest),
        ChatCompletionRequest,
    )
    creq = parse_completion_request(comp(prompt=[1, 2]))
    assert msgspec.json.decode(msgspec.json.encode(creq), type=CompletionRequest).prompt == [1, 2]


# --- the official client end to end (in-process transport, no network) ---------------------


def openai_client(handler):
    return openai.OpenAI(
        api_key="k",
        base_url="http://meshserve.test/v1",
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
        max_retries=0,
    )


def test_official_client_chat_stream_roundtrip():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        req = parse_chat_request(request.content)
        seen["req"] = req
        cid = r.chat_id()
        frames = [
            r.sse(r.chat_chunk(cid, req.model, 1, delta={"role": "assistant", "content": ""}))
        ]
        frames += [
            r.sse(r.chat_chunk(cid, req.model, 1, delta={"content": t})) for t in ("Hi", "!")
        ]
        frames.append(r.sse(r.chat_chunk(cid, req.model, 1, delta={}, finish_reason="stop")))
        frames.append(r.sse(r.usage_chunk(cid, req.model, 1, r.usage(3, 2))))
        frames.append(r.SSE_DONE)
        return httpx.Response(
            200, content=b"".join(frames), headers={"content-type": "text/event-stream"}
        )

    client = openai_client(handler)
    stream = client.chat.completions.create(
        model="qwen",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
        ],
        max_completion_tokens=8,
        stop=["\n"],
        seed=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hi!"
    assert chunks[-1].usage.total_tokens == 5
    req = seen["req"]
    assert req.max_output_tokens == 8 and req.include_usage and req.stop_strings == ["\n"]


def test_official_client_completion_and_error():
    def handler(request: httpx.Request) -> httpx.Response:
        try:
            req = parse_completion_request(request.content)
        except BadRequest as err:
            return httpx.Response(err.status, json=r.error_body(err))
        obj = r.completion(r.completion_id(), req.model, 1, "out", "length", r.usage(2, 16))
        return httpx.Response(
            200, content=r.json_body(obj), headers={"content-type": "application/json"}
        )

    client = openai_client(handler)
    res = client.completions.create(model="m", prompt=[1, 2])
    assert res.choices[0].text == "out" and res.usage.completion_tokens == 16
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="m", prompt="x", n=2)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == "n"

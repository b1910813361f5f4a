"""Decode and check OpenAI request bodies; derive the engine's sampling parameters.

Every problem with a request raises ``shared.errors.BadRequest`` (HTTP 400) whose ``param``
names the offending field the way OpenAI does (``messages[0].content``, ``temperature``),
so the HTTP layer only has to send ``err.to_openai()`` with ``err.status``.

Public API::

    parse_chat_request(body: bytes) -> ChatCompletionRequest
    parse_completion_request(body: bytes) -> CompletionRequest
    sampling_params(req, *, prompt_tokens: int, max_context: int,
                    eos_token_ids: Iterable[int]) -> SamplingParams
    check_text_size(chars: int, max_context: int, param: str) -> None

``check_text_size`` runs before tokenization (a text too long for any tokenizer to fit
the context is refused without it), ``sampling_params`` after it, because the output
budget depends on the prompt's length. Stop *strings* are not part of ``SamplingParams``:
the frontend applies them to the detokenized text with
``services.frontend.stop.StopMatcher`` and cancels the task on a hit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import msgspec

from services.frontend.openai_types import ROLES, ChatCompletionRequest, CompletionRequest
from shared.errors import BadRequest
from shared.messages.api import SamplingParams

MAX_STOP_STRINGS = 4

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)

_MISSING = re.compile(r"^Object missing required field `(?P<field>[^`]+)`$")


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    req = decode_json(_chat_decoder, body)
    _check_common(req)
    _check_messages(req)
    _check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
    _check_max_tokens(req.max_tokens, "max_tokens")
    if req.logprobs:
        raise BadRequest("logprobs are not supported.", param="logprobs")
    if req.top_logprobs:
        raise BadRequest("top_logprobs are not supported.", param="top_logprobs")
    if req.tools:
        raise BadRequest("Tool calling is not supported.", param="tools")
    if req.response_format is not None and req.response_format.type != "text":
        raise BadRequest(
            f"response_format type '{req.response_format.type}' is not supported; only 'text' is.",
            param="response_format",
        )
    _check_min_tokens(req)
    return req


def parse_completion_request(body: bytes) -> CompletionRequest:
    req = decode_json(_completion_decoder, body)
    _check_common(req)
    _check_prompt(req.prompt)
    _check_max_tokens(req.max_tokens, "max_tokens")
    if req.logprobs is not None:
        raise BadRequest("logprobs are not supported.", param="logprobs")
    if req.echo:
        raise BadRequest("echo is not supported.", param="echo")
    if req.suffix:
        raise BadRequest("suffix is not supported.", param="suffix")
    if req.best_of is not None and req.best_of != 1:
        raise BadRequest("Only best_of=1 is supported.", param="best_of")
    _check_min_tokens(req)
    return req


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    prompt_tokens: int,
    max_context: int,
    eos_token_ids: Iterable[int],
) -> SamplingParams:
    """The engine's sampling parameters for a validated request whose prompt is
    ``prompt_tokens`` long, on a model whose context holds ``max_context`` tokens.

    Without an explicit limit the output may fill the rest of the context. With
    ``ignore_eos`` the EOS ids are left out of ``stop_token_ids`` *and* ``ignore_eos`` is
    set, so an engine honouring either one runs to ``max_tokens``.
    """
    noun = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
    if prompt_tokens < 1:
        raise BadRequest(f"The {noun} must not be empty.", param=noun)
    requested = req.max_output_tokens
    if requested is None:
        if prompt_tokens >= max_context:
            raise BadRequest(
                f"This model's maximum context length is {max_context} tokens. However, your "
                f"{noun} resulted in {prompt_tokens} tokens. Please reduce the length of the "
                f"{noun}.",
                param=noun,
                code="context_length_exceeded",
            )
        max_tokens = max_context - prompt_tokens
    else:
        max_tokens = requested
        if prompt_tokens + max_tokens > max_context:
            raise BadRequest(
                f"This model's maximum context length is {max_context} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"{noun}, {max_tokens} in the completion). Please reduce the length of the "
                f"{noun} or completion.",
                param=noun,
                code="context_length_exceeded",
            )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop_token_ids=[] if req.ignore_eos else list(eos_token_ids),
        ignore_eos=req.ignore_eos,
    )


# No tokenizer packs more characters than this into one token; a text longer than the
# context times this cannot fit, so it is refused before the (costly) tokenization.
MAX_CHARS_PER_TOKEN = 64


def check_text_size(chars: int, max_context: int, param: str) -> None:
    if chars > max_context * MAX_CHARS_PER_TOKEN:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"{param} hold {chars} characters, more than any {max_context}-token text. Please "
            f"reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def decode_json(decoder: msgspec.json.Decoder, body: bytes):
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:  # a subclass of DecodeError, so it goes first
        raise _translate(str(e)) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        # msgspec raises UnicodeDecodeError, not DecodeError, for invalid UTF-8 in a string.
        raise _unparsable(str(e)) from None
    except RecursionError:
        # msgspec decodes (and skips unknown fields) recursively, under Python's recursion
        # limit: JSON nested that deep is no request anyone means to send.
        raise _unparsable("it is nested too deeply") from None


def _unparsable(why: str) -> BadRequest:
    return BadRequest(
        f"We could not parse the JSON body of your request ({why}). The API expects a "
        "JSON object in the request body.",
    )


def _translate(detail: str) -> BadRequest:
    """Turn msgspec's ``<what> - at `$.a[0].b``` into a message and an OpenAI-style param."""
    what, sep, where = detail.rpartition(" - at `")
    if sep:
        path = where.rstrip("`").removeprefix("$").removeprefix(".") or None
    else:
        what, path = detail, None
    missing = _MISSING.match(what)
    if missing:
        field = missing["field"]
        param = f"{path}.{field}" if path else field
        return BadRequest(f"Missing required parameter: '{param}'.", param=param)
    if path is None:
        return BadRequest(f"The request body must be a JSON object: {what}.")
    return BadRequest(f"Invalid value for '{path}': {what}.", param=path)


def _check_common(req: ChatCompletionRequest | CompletionRequest) -> None:
    t = req.temperature
    if t is not None and not 0.0 <= t <= 2.0:
        raise BadRequest(f"temperature must be between 0 and 2, got {t}.", param="temperature")
    p = req.top_p
    if p is not None and not 0.0 < p <= 1.0:
        raise BadRequest(f"top_p must be greater than 0 and at most 1, got {p}.", param="top_p")
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v is not None and not -2.0 <= v <= 2.0:
            raise BadRequest(f"{name} must be between -2 and 2, got {v}.", param=name)
    if req.n is not None and req.n != 1:
        raise BadRequest(f"Only n=1 is supported, got n={req.n}.", param="n")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
        raise BadRequest(
            f"At most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(req.stop)}.",
            param="stop",
        )
    if req.stream_options is not None and not req.stream:
        raise BadRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )


def _check_max_tokens(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise BadRequest(f"{param} must be at least 1, got {value}.", param=param)


def _check_min_tokens(req: ChatCompletionRequest | CompletionRequest) -> None:
    v = req.min_tokens
    if v is None or v == 0:
        return
    if v < 0:
        raise BadRequest(f"min_tokens must be at least 0, got {v}.", param="min_tokens")
    # SamplingParams has no min_tokens yet; silently ignoring it would return shorter output
    # than the client demanded.
    raise BadRequest("min_tokens greater than 0 is not supported.", param="min_tokens")


def _check_messages(req: ChatCompletionRequest) -> None:
    if not req.messages:
        raise BadRequest("messages must contain at least one message.", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            allowed = ", ".join(f"'{r}'" for r in ROLES)
            raise BadRequest(
                f"Invalid role '{m.role}' in messages[{i}]; expected one of {allowed}.",
                param=f"messages[{i}].role",
            )
        if m.content is None:
            # An assistant turn that only made tool calls has no content.
            if m.role != "assistant":
                raise BadRequest(
                    f"Missing required parameter: 'messages[{i}].content'.",
                    param=f"messages[{i}].content",
                )
            continue
        if isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            if part.type != "text":
                raise BadRequest(
                    f"Unsupported content part type '{part.type}' in messages[{i}]: "
                    "only text content is supported.",
                    param=f"messages[{i}].content[{j}].type",
                )
            if part.text is None:
                raise BadRequest(
                    f"Missing required parameter: 'messages[{i}].content[{j}].text'.",
                    param=f"messages[{i}].content[{j}].text",
                )


def _check_prompt(prompt: str | list) -> None:
    if isinstance(prompt, str):
        return
    if not prompt:
        raise BadRequest("prompt must not be empty.", param="prompt")
    first = prompt[0]
    if isinstance(first, int):
        _check_token_ids(prompt, "prompt")
        return
    if len(prompt) != 1:
        raise BadRequest(
            f"Only a single prompt per request is supported, got {len(prompt)}.",
            param="prompt",
        )
    if isinstance(first, list):
        if not first:
            raise BadRequest("prompt[0] must not be empty.", param="prompt[0]")
        _check_token_ids(first, "prompt[0]")


def _check_token_ids(ids: list, param: str) -> None:
    for k, t in enumerate(ids):
        if not isinstance(t, int):
            raise BadRequest(
                f"{param} mixes token ids with other values; expected a list of integers.",
                param=f"{param}[{k}]",
            )
        if t < 0:
            raise BadRequest(f"Token ids must not be negative, got {t}.", param=f"{param}[{k}]")

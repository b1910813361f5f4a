"""Request bodies of the OpenAI API as msgspec Structs: what the official ``openai`` client
sends to ``POST /v1/chat/completions`` and ``POST /v1/completions``.

These types only describe the JSON shape; ``services.frontend.validation`` decodes a body
into them and then checks ranges and supported features. Fields the API defines but that
meshserve does not model are ignored, as vLLM ignores them, so a client that sends, say,
``metadata`` or ``service_tier`` still works.

Accepted but without effect (documented, not rejected):

- ``presence_penalty`` and ``frequency_penalty``: range-checked (-2..2) like OpenAI, then
  ignored. OpenAI treats them as soft hints and many clients send them by default, so
  rejecting non-zero values would break those clients for little benefit.
- ``user``, ``tool_choice`` (when no tools are given), ``stream_options.include_obfuscation``.

Rejected with 400 (see validation): ``n`` other than 1, ``logprobs``/``top_logprobs``,
``echo``, ``suffix``, ``best_of`` other than 1, non-empty ``tools``, a ``response_format``
other than text, ``min_tokens`` > 0, and content parts other than text.

Conveniences the frontend uses after validation:

- ``ChatCompletionRequest.template_messages()``: messages as plain dicts with string content,
  ready for a chat template.
- ``CompletionRequest.prompt_input()``: the prompt as ``str`` or ``list[int]``.
- ``.max_output_tokens``, ``.stop_strings``, ``.include_usage``, ``.is_stream`` on both.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

ROLES = ("system", "developer", "user", "assistant", "tool")

# A seed is a signed 64-bit integer, as in OpenAI's API: every engine's generator takes one,
# and the bus (msgpack) carries nothing wider.
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class ContentPart(msgspec.Struct, forbid_unknown_fields=False):
    """One element of a list-valued ``content``. Only ``type == "text"`` is supported;
    other types (image_url, input_audio, file, refusal) decode so validation can name them."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as one string. Text parts are joined with newlines, as vLLM does for
        templates that expect string content."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=False):
    type: str


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """Fields both endpoints share."""

    model: str
    temperature: float | None = None
    top_p: float | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # vLLM extensions
    ignore_eos: bool = False
    min_tokens: int | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def stop_strings(self) -> list[str]:
        """Stop strings for ``StopMatcher``; empty strings would match at once, so they are
        dropped rather than ending every response before its first character."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]


class ChatCompletionRequest(_Common, kw_only=True, forbid_unknown_fields=False):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: ResponseFormat | None = None

    @property
    def max_output_tokens(self) -> int | None:
        """The client's output limit; ``max_completion_tokens`` replaced ``max_tokens`` in
        the OpenAI API, so it wins when both are sent."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as dicts with string content, for ``tokenizer.apply_chat_template``."""
        out: list[dict[str, Any]] = []
        for m in self.messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                d["tool_calls"] = m.tool_calls
            out.append(d)
        return out


class CompletionRequest(_Common, kw_only=True, forbid_unknown_fields=False):
    # Element union rather than four list types: msgspec allows one array type per union.
    # Validation checks that the list is homogeneous and of a supported shape.
    prompt: str | list[str | int | list[int]]
    # OpenAI's and vLLM's default for the legacy endpoint; an explicit null means "up to the
    # context length".
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_input(self) -> str | list[int]:
        """The single prompt, as text to tokenize or as token ids. Call after validation."""
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return list(p)  # type: ignore[arg-type]

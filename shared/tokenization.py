"""Tokenizers and chat templates for the frontend, without transformers.

``ModelTokenizer`` reads a Hugging Face model directory (tokenizer.json, tokenizer_config.json,
config.json, generation_config.json, chat templates) and reproduces what
``transformers.AutoTokenizer`` does with it: the same ids for ``encode`` and for
``apply_chat_template(..., tokenize=True)``, the same text for ``decode``. Importing
transformers would cost the frontend seconds of start-up and hundreds of MB per process for
no gain; parity is checked by tests/unit/test_tokenization.py.

``IncrementalDetokenizer`` turns a stream of generated ids into text deltas for streaming
responses, never splitting a multi-byte character.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models

from shared.errors import BadRequest, Internal

# The names transformers passes to chat templates as variables (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# Config keys that different model families use for their context length, in preference order.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_positions",
    "n_ctx",
)
_DEFAULT_CONTEXT = 2048
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_HOLD = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _token_text(value: Any) -> str | None:
    """tokenizer_config stores a special token as a string or as a serialized AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        content = value.get("content")
        if isinstance(content, str):
            return content
    return None


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# --------------------------------------------------------------------------- chat templates


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` marks assistant text for training masks;
    rendering only needs the body."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which no chat template wants.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    # Templates may build dicts, but must not reach the dict type and its attributes.
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Dunder attributes on a namespace are a path to CPython internals from a Hub template.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a template the way transformers does, so Hub templates render identically."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """Only JSON-shaped data reaches the sandbox: rich objects carry methods it does not
    know to be dangerous."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    to_builtins = getattr(type(value), "__struct_fields__", None)
    if to_builtins is not None:  # a msgspec.Struct
        return {f: _plain(getattr(value, f)) for f in to_builtins}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for message in messages:
        message = _plain(message)
        if not isinstance(message, dict):
            raise BadRequest("each message must be an object", param="messages")
        # transformers drops None values (OpenAI clients send content=None with tool calls),
        # and fills reasoning_content/thinking from whichever reasoning field is present.
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _load_chat_templates(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """All named templates; the unnamed one is "default". As in transformers, template files
    next to the config win over the config's ``chat_template`` field."""
    templates: dict[str, str] = {}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = model_dir / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = tokenizer_config.get("chat_template")
    if raw is None:
        # Processors (multimodal checkpoints) keep it in chat_template.json.
        raw = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        return {t["name"]: t["template"] for t in raw}
    if isinstance(raw, dict):
        return dict(raw)
    return {}


# --------------------------------------------------------------------------- byte-level BPE


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, used by ByteLevel BPE."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_CHAR_BYTES = {c: b for b, c in _bytes_to_unicode().items()}


def _byte_level_bytes(token: str) -> bytes:
    # The ByteLevel decoder's rule: map every char back to its byte; a token with a char
    # outside the map (an added token such as "<think> ") goes out as its own UTF-8.
    try:
        return bytes(_CHAR_BYTES[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _byte_table(tok: Tokenizer) -> list[bytes]:
    """The bytes each id decodes to; b"" for ids the vocabulary does not have, which
    tokenizers' decode skips (models often have more embedding rows than tokens)."""
    vocab = tok.get_vocab(with_added_tokens=True)
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        table[i] = _byte_level_bytes(token)
    return table


# --------------------------------------------------------------------------- tokenizer


class ModelTokenizer:
    """The tokenizer and chat template of one model directory."""

    def __init__(
        self,
        *,
        tokenizer: Tokenizer,
        name_or_path: str,
        special_tokens: Mapping[str, str],
        chat_templates: Mapping[str, str],
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        max_context: int,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.name_or_path = name_or_path
        self.special_tokens = dict(special_tokens)
        self.chat_templates = dict(chat_templates)
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(eos_token_ids)
        self.max_context = max_context
        self._clean_up = clean_up_tokenization_spaces
        self._compiled: dict[str, jinja2.Template] = {}
        self._byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        # Built here, not on the first request: from_dir runs off the event loop, and for a
        # 150k vocabulary this takes a noticeable fraction of a second.
        self._token_bytes = _byte_table(tokenizer) if self._byte_level else []
        added = tokenizer.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, t in added.items() if t.special)

    @classmethod
    def from_dir(cls, path: Path) -> ModelTokenizer:
        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} is missing (only fast tokenizers are supported)")
        tok = Tokenizer.from_file(str(tok_file))
        tcfg = _read_json(path / "tokenizer_config.json")
        tcfg = {**_read_json(path / "special_tokens_map.json"), **tcfg}
        config = _read_json(path / "config.json")
        text_config = config.get("text_config") or {}
        gen = _read_json(path / "generation_config.json")

        # One encode() must not silently cut or pad a prompt; transformers turns both off too.
        tok.no_truncation()
        tok.no_padding()
        special = {
            name: text for name in _NAMED_SPECIAL_TOKENS if (text := _token_text(tcfg.get(name)))
        }

        bos_id = next(
            (
                v
                for v in (gen.get("bos_token_id"), config.get("bos_token_id"))
                if isinstance(v, int)
            ),
            None,
        )
        if bos_id is None and "bos_token" in special:
            bos_id = tok.token_to_id(special["bos_token"])

        eos_ids: list[int] = []
        tok_eos = tok.token_to_id(special["eos_token"]) if "eos_token" in special else None
        for ids in (
            _as_id_list(gen.get("eos_token_id")),
            _as_id_list(config.get("eos_token_id")),
            _as_id_list(text_config.get("eos_token_id")),
            _as_id_list(tok_eos),
        ):
            eos_ids.extend(i for i in ids if i not in eos_ids)

        max_context = next(
            (
                c[k]
                for c in (config, text_config)
                for k in _CONTEXT_KEYS
                if isinstance(c.get(k), int) and c[k] > 0
            ),
            None,
        )
        if max_context is None:
            mml = tcfg.get("model_max_length")
            # transformers writes a huge sentinel when the tokenizer has no limit of its own.
            max_context = mml if isinstance(mml, int) and 0 < mml < 10**8 else _DEFAULT_CONTEXT

        return cls(
            tokenizer=tok,
            name_or_path=str(path),
            special_tokens=special,
            chat_templates=_load_chat_templates(path, tcfg),
            bos_token_id=bos_id,
            eos_token_ids=eos_ids,
            max_context=max_context,
            # transformers skips the clean-up for BPE: it would eat real spaces.
            clean_up_tokenization_spaces=bool(tcfg.get("clean_up_tokenization_spaces"))
            and not isinstance(tok.model, models.BPE),
        )

    # ----------------------------------------------------------------- plain text

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    # ----------------------------------------------------------------- chat

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def _template(self, name: str | None, tools: Any) -> jinja2.Template:
        templates = self.chat_templates
        if not templates:
            raise BadRequest(
                f"model {self.name_or_path} has no chat template; use /v1/completions",
                param="messages",
            )
        if name is None:
            if tools is not None and "tool_use" in templates:
                name = "tool_use"
            elif "default" in templates:
                name = "default"
            elif len(templates) == 1:
                name = next(iter(templates))
            else:
                raise BadRequest(
                    f"model {self.name_or_path} has several chat templates "
                    f"({', '.join(sorted(templates))}) and none is the default"
                )
        if name not in templates:
            raise BadRequest(f"no chat template named {name!r}", param="chat_template")
        if name not in self._compiled:
            try:
                self._compiled[name] = compile_chat_template(templates[name])
            except jinja2.TemplateSyntaxError as e:
                # The model's files are broken, not the request.
                raise Internal(f"chat template of {self.name_or_path} does not compile: {e}") from e
        return self._compiled[name]

    def render_chat(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text, as ``apply_chat_template(..., tokenize=False)`` renders it.
        ``chat_template`` names one of the model's templates; ``kwargs`` become template
        variables (e.g. ``enable_thinking``) and override the special tokens."""
        if not messages:
            raise BadRequest("messages must not be empty", param="messages")
        template = self._template(chat_template, tools)
        variables = {**self.special_tokens, **_plain(kwargs)}
        try:
            return template.render(
                messages=_prepare_messages(messages),
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as e:
            # The template compiled, so a failure is about these messages: its own checks
            # (raise_exception: "roles must alternate") or a shape it cannot handle (a list
            # where it adds strings). Either way the client's to fix.
            raise BadRequest(f"chat template rejected the messages: {e}", param="messages") from e

    def encode_chat(
        self,
        messages: Sequence[Any],
        *,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """The prompt ids, equal to ``apply_chat_template(..., tokenize=True)``. The template
        writes every special token the model wants (BOS included), so, as in transformers,
        the tokenizer adds none of its own: no double BOS."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # ----------------------------------------------------------------- streaming

    def detokenizer(
        self, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True
    ) -> IncrementalDetokenizer:
        if self._byte_level:
            return _ByteLevelDetokenizer(self, skip_special_tokens=skip_special_tokens)
        return _WindowDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


def _clean_up(text: str) -> str:
    # transformers' clean_up_tokenization, for the WordPiece-era configs that ask for it.
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


# --------------------------------------------------------------------------- detokenizers


class IncrementalDetokenizer:
    """Text deltas of a growing id sequence. Concatenating every ``push`` and the final
    ``flush`` gives ``decode(all ids)``; a character split across tokens comes out whole
    with the token that completes it, never as U+FFFD."""

    def push(self, token_ids: Sequence[int]) -> str:
        raise NotImplementedError

    def flush(self) -> str:
        """The text held back for an unfinished character, once the stream has ended (as
        U+FFFD, as a full decode would show it)."""
        raise NotImplementedError


class _ByteLevelDetokenizer(IncrementalDetokenizer):
    """For byte-level BPE (GPT-2, Llama 3, Qwen): each token is a fixed byte string, so a
    streaming UTF-8 decoder does the work in O(1) per token, without any context."""

    def __init__(self, owner: ModelTokenizer, *, skip_special_tokens: bool) -> None:
        self._bytes = owner._token_bytes
        self._skip = owner._special_ids if skip_special_tokens else frozenset()
        # "replace" substitutes maximal subparts, like Rust's from_utf8_lossy in tokenizers.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_ids: Sequence[int]) -> str:
        table, skip, n = self._bytes, self._skip, len(self._bytes)
        data = b"".join(table[i] for i in token_ids if i not in skip and 0 <= i < n)
        return self._utf8.decode(data)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


# Context kept before the first generated token: enough for decoders (SentencePiece's
# Metaspace) whose output for a token depends on what precedes it.
_PROMPT_CONTEXT = 5


class _WindowDetokenizer(IncrementalDetokenizer):
    """Any other decoder: vLLM's prefix/read offsets. Decode the window since the last
    emitted boundary twice, with and without the new tokens, and emit the difference
    unless it ends in U+FFFD (an unfinished character). The window is trimmed at every
    emit, so each push costs O(window), not O(sequence).

    One known gap, shared with vLLM: ByteFallback turns a whole run of byte tokens into one
    U+FFFD per byte when the run is not valid UTF-8, so a run that was emitted as valid
    text and is later followed by a stray byte decodes differently in one piece. Only
    invalid UTF-8 is affected."""

    def __init__(
        self, owner: ModelTokenizer, prompt_ids: Sequence[int], *, skip_special_tokens: bool
    ) -> None:
        self._tok = owner._tok
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._read = len(self._ids)  # ids before this are already emitted (or prompt)
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(_HOLD):
            return ""
        delta = text[len(self._prefix_text) :]
        # Next window starts at the tokens just read, decoded on their own as the prefix.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def flush(self) -> str:
        text = self._decode(self._ids)
        delta = text[len(self._prefix_text) :] if len(text) > len(self._prefix_text) else ""
        self._ids, self._read, self._prefix_text = [], 0, ""
        return delta

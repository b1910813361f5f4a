"""shared.tokenization against transformers: same prompt ids, same text, and streaming text
that never shows a half character."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from shared.errors import BadRequest
from shared.tokenization import ModelTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The Program is free software.",
    "",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "Unicode: héllo wörld, 世界, こんにちは, emoji 😀👍🏽 and 🇫🇷",
    "Numbers 1234567 and 3.14159, code: def f(x): return x**2",
    "special tokens in text: <|im_start|>user\nhi<|im_end|>",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello 😀 世界"}],
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is free software?"},
        {"role": "assistant", "content": "Software that respects your freedom."},
        {"role": "user", "content": "And the GPL?"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}],
        }
    ],
    # OpenAI clients send null fields; transformers drops them before rendering.
    [
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "yo", "tool_calls": None},
    ],
]

# Exercises what Hub templates use: namespace, loop controls, tojson, generation tags,
# raise_exception, and whitespace control through trim_blocks/lstrip_blocks.
RICH_TEMPLATE = """
{%- set ns = namespace(system=none) %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% set ns.system = m.content %}{% endif %}
{%- endfor %}
{{- bos_token }}
{%- if ns.system is not none %}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% endif %}
{%- if tools %}
<|im_start|>tools
    {% for t in tools %}
{{ t | tojson }}
    {% endfor %}
<|im_end|>
{% endif %}
{%- for m in messages %}
    {%- if m.role == 'system' %}{% continue %}{% endif %}
    {%- if m.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ m.content }}{% endgeneration %}<|im_end|>
    {% elif m.role in ['user', 'tool'] %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
    {% else %}
{{ raise_exception('unknown role: ' + m.role) }}
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "<str>"}}}]


@pytest.fixture(scope="module")
def ours(demo_tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def hf(demo_tokenizer_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(demo_tokenizer_dir)


def _variant(src: Path, dst: Path, **config_changes: Any) -> Path:
    """A copy of the demo model dir with tokenizer_config.json fields changed (None deletes)."""
    shutil.copytree(src, dst)
    path = dst / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    for k, v in config_changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))
    return dst


def _hf_chat_ids(hf_tok: Any, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding by default.
    return hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs)


# --------------------------------------------------------------------------- metadata


def test_model_metadata(ours: ModelTokenizer) -> None:
    assert ours.bos_token_id == ours.token_to_id("<|begin_of_text|>")
    assert ours.eos_token_ids[0] == ours.token_to_id("<|im_end|>")
    assert ours.token_to_id("<|endoftext|>") in ours.eos_token_ids
    assert ours.max_context >= 4096
    assert ours.vocab_size == 4096


# --------------------------------------------------------------------------- encode / decode


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(
    ours: ModelTokenizer, hf: Any, add_special_tokens: bool
) -> None:
    for text in TEXTS:
        expected = hf.encode(text, add_special_tokens=add_special_tokens)
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_special_token_text_becomes_special_ids(ours: ModelTokenizer) -> None:
    ids = ours.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == ours.token_to_id("<|im_start|>")


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_matches_transformers(
    ours: ModelTokenizer, hf: Any, skip_special_tokens: bool
) -> None:
    rng = random.Random(0)
    sequences = [ours.encode(t) for t in TEXTS]
    sequences += [
        [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(200)
    ]
    for ids in sequences:
        assert ours.decode(ids, skip_special_tokens=skip_special_tokens) == hf.decode(
            ids, skip_special_tokens=skip_special_tokens
        ), ids


def test_round_trip(ours: ModelTokenizer) -> None:
    for text in TEXTS[:-1]:  # the last one's special tokens are skipped on the way back
        assert ours.decode(ours.encode(text)) == text


@pytest.mark.parametrize(
    "changes",
    [
        {"add_bos_token": False},
        {"add_bos_token": True, "add_eos_token": True},
    ],
    ids=["no-bos", "bos-and-eos"],
)
def test_add_bos_eos_flags_are_ignored_like_transformers(
    demo_tokenizer_dir: Path, tmp_path: Path, changes: dict[str, Any]
) -> None:
    # transformers 5 drops these flags when tokenizer.json is there: its post-processor rules.
    d = _variant(demo_tokenizer_dir, tmp_path / "m", **changes)
    ours, hf = ModelTokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text


# --------------------------------------------------------------------------- chat templates


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_matches_transformers(
    ours: ModelTokenizer, hf: Any, conversation: int, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[conversation]
    text = ours.render_chat(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours.encode_chat(messages, add_generation_prompt=add_generation_prompt) == _hf_chat_ids(
        hf, messages, add_generation_prompt=add_generation_prompt
    )
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_has_exactly_one_bos(ours: ModelTokenizer) -> None:
    ids = ours.encode_chat([{"role": "user", "content": "hi"}])
    assert ids[0] == ours.bos_token_id
    assert ids.count(ours.bos_token_id) == 1


def test_named_templates_in_config(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    default = json.loads((demo_tokenizer_dir / "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    d = _variant(
        demo_tokenizer_dir,
        tmp_path / "m",
        chat_template=[
            {"name": "default", "template": default},
            {"name": "tool_use", "template": RICH_TEMPLATE},
        ],
    )
    ours, hf = ModelTokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    for messages in CONVERSATIONS[:2]:
        for kwargs in ({}, {"tools": TOOLS}, {"chat_template": "tool_use"}):
            assert ours.encode_chat(messages, **kwargs) == _hf_chat_ids(
                hf, messages, add_generation_prompt=True, **kwargs
            ), kwargs
    # With tools, the tool_use template is chosen on its own.
    assert "get_weather" in ours.render_chat(CONVERSATIONS[0], tools=TOOLS)
    assert "get_weather" not in ours.render_chat(CONVERSATIONS[0])


def test_template_file_wins_over_config(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _variant(demo_tokenizer_dir, tmp_path / "m")
    (d / "chat_template.jinja").write_text(RICH_TEMPLATE)
    ours, hf = ModelTokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            assert ours.render_chat(messages, add_generation_prompt=gen) == hf.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )


def test_template_errors_are_bad_requests(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    d = _variant(demo_tokenizer_dir, tmp_path / "m", chat_template=RICH_TEMPLATE)
    ours = ModelTokenizer.from_dir(d)
    with pytest.raises(BadRequest, match="unknown role: narrator"):
        ours.render_chat([{"role": "narrator", "content": "Once upon a time"}])
    with pytest.raises(BadRequest):
        ours.render_chat([])
    strict = ModelTokenizer.from_dir(
        _variant(
            demo_tokenizer_dir, tmp_path / "strict", chat_template="{{ messages[0].content + '!' }}"
        )
    )
    with pytest.raises(BadRequest):  # a content list where the template adds strings
        strict.render_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    plain = ModelTokenizer.from_dir(
        _variant(demo_tokenizer_dir, tmp_path / "plain", chat_template=None)
    )
    assert not plain.has_chat_template
    with pytest.raises(BadRequest, match="no chat template"):
        plain.render_chat([{"role": "user", "content": "hi"}])


def test_template_cannot_escape_sandbox(demo_tokenizer_dir: Path, tmp_path: Path) -> None:
    evil = "{{ messages.__class__.__mro__ }}"
    ours = ModelTokenizer.from_dir(_variant(demo_tokenizer_dir, tmp_path / "m", chat_template=evil))
    with pytest.raises(BadRequest):
        ours.render_chat([{"role": "user", "content": "hi"}])


# --------------------------------------------------------------------------- streaming


def _stream(tok: ModelTokenizer, ids: list[int], rng: random.Random, **kwargs: Any) -> list[str]:
    detok = tok.detokenizer(**kwargs)
    pieces, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 1, 2, 3])
        pieces.append(detok.push(ids[i : i + n]))
        i += n
    pieces.append(detok.flush())
    return pieces


MULTIBYTE = [
    "😀👍🏽🇫🇷 emoji in a row",
    "世界你好，这是中文。日本語のテキスト",
    "mixed: naïve café 世界 😀 end",
    "Ωμέγα and ẞ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _random_text_ids(tok: ModelTokenizer, rng: random.Random) -> list[int]:
    pieces = [w for text in TEXTS[:-1] + MULTIBYTE for w in text.split(" ")]
    pieces += ["<|im_end|>", "<s>", "</s>", "😀", "世"]
    text = " ".join(rng.choice(pieces) for _ in range(rng.randrange(1, 12)))
    return tok.encode(text, add_special_tokens=rng.random() < 0.5)


def _assert_streams_like_decode(tok: ModelTokenizer, seed: int, *, any_ids: bool) -> None:
    """``any_ids``: also arbitrary id sequences, invalid UTF-8 included (byte-level BPE only,
    see _WindowDetokenizer)."""
    rng = random.Random(seed)
    for text in MULTIBYTE:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = _stream(tok, ids, rng)
        assert "".join(pieces) == tok.decode(ids) == text
        # A split character is held back, not shown as U+FFFD and fixed later.
        assert not any("\ufffd" in p for p in pieces), pieces
    for _ in range(300):
        if any_ids:
            ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        else:
            ids = _random_text_ids(tok, rng)
        for skip in (True, False):
            pieces = _stream(tok, ids, rng, skip_special_tokens=skip)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip), ids


def test_detokenizer_streams_like_decode(ours: ModelTokenizer) -> None:
    text = MULTIBYTE[0]
    ids = ours.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # characters really are split across tokens
    _assert_streams_like_decode(ours, seed=1, any_ids=True)
    _assert_streams_like_decode(ours, seed=2, any_ids=False)


def test_detokenizer_emits_as_soon_as_a_character_completes(ours: ModelTokenizer) -> None:
    ids = ours.encode("a😀b", add_special_tokens=False)
    detok = ours.detokenizer()
    outputs = [detok.push([i]) for i in ids]
    assert outputs[0] == "a"
    assert "".join(outputs) == "a😀b"
    assert detok.flush() == ""


def test_detokenizer_skips_special_tokens(ours: ModelTokenizer) -> None:
    ids = ours.encode("hello<|im_end|>", add_special_tokens=True)
    assert "".join(_stream(ours, ids, random.Random(0))) == "hello"
    shown = "".join(_stream(ours, ids, random.Random(0), skip_special_tokens=False))
    assert shown == "<|begin_of_text|>hello<|im_end|>"


def test_ids_past_the_vocabulary_decode_to_nothing(ours: ModelTokenizer) -> None:
    # The bench model has 151936 embedding rows for a 4096-token tokenizer.
    ids = [*ours.encode("ab", add_special_tokens=False), 5000, 151935]
    assert ours.decode(ids) == "ab"
    assert "".join(_stream(ours, ids, random.Random(0))) == "ab"


def test_detokenizer_flushes_unfinished_character(ours: ModelTokenizer) -> None:
    ids = ours.encode("😀", add_special_tokens=False)
    detok = ours.detokenizer()
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == ours.decode(ids[:-1])


def _sentencepiece_style_dir(tmp_path: Path) -> Path:
    """A Llama-2-style tokenizer (▁ for spaces, byte fallback, a decoder that strips the
    first space): the generic, window-based detokenizer path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    special = ["<unk>", "<s>", "</s>"]
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    trainer_tok.train_from_iterator(
        TEXTS[:1] + ["the quick brown fox jumps over the lazy dog"] * 3, trainer
    )
    model = json.loads(trainer_tok.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=[tuple(m) for m in model["merges"]],
            unk_token="<unk>",
            byte_fallback=True,
            fuse_unk=True,
        )
    )
    tok.add_special_tokens(special)
    tok.pre_tokenizer = trainer_tok.pre_tokenizer
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    d = tmp_path / "sp"
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "clean_up_tokenization_spaces": False,
            }
        )
    )
    (d / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "eos_token_id": 2}))
    return d


def test_window_detokenizer_for_other_decoders(tmp_path: Path) -> None:
    d = _sentencepiece_style_dir(tmp_path)
    tok = ModelTokenizer.from_dir(d)
    assert type(tok.detokenizer()).__name__ == "_WindowDetokenizer"
    hf = transformers.AutoTokenizer.from_pretrained(d)
    for text in TEXTS + MULTIBYTE:
        assert tok.encode(text) == hf.encode(text), text
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    _assert_streams_like_decode(tok, seed=3, any_ids=False)
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2] and tok.max_context == 4096


def test_window_detokenizer_keeps_space_after_prompt(tmp_path: Path) -> None:
    tok = ModelTokenizer.from_dir(_sentencepiece_style_dir(tmp_path))
    prompt = tok.encode("the quick")
    out = tok.encode("the quick brown fox", add_special_tokens=True)[len(prompt) :]
    detok = tok.detokenizer(prompt)
    # Decoded on its own, "▁brown" would lose its space (Strip); after the prompt it keeps it.
    assert "".join(detok.push([i]) for i in out) + detok.flush() == " brown fox"

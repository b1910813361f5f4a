"""Synthetic prompts of an exact token length, with exactly the trace's prefix sharing.

A trace gives lengths and (Mooncake, Bailian, synth) block hash ids, never text. The prompt
for a request is built as token ids from a *pool* of the target tokenizer's tokens that are
whole words with a leading space (``" river"``): with word-splitting pre-tokenizers (GPT-2,
Llama 3, Qwen, SentencePiece) such a sequence decodes to text that re-encodes to the very
same ids, so a text prompt has exactly the intended length. The pool is verified when it is
built: tokens that fail the decode → encode round trip in a sequence are dropped.

Layout of a prompt of ``n`` tokens (``prompt_ids``):

- the tokenizer's own leading special tokens (BOS), which a server adds to a text prompt
  (they take the first places of block 0, so block ``i`` is prompt positions
  ``[i*block_size, (i+1)*block_size)``, as a server's KV blocks are);
- then, block by block, the content of ``hash_ids[i]``: a pure function of the id and the
  seed, so equal ids give equal blocks. Its first three tokens spell the id in base
  ``len(digits)``, least significant digit first, so two prompts that share the first k ids
  share the first ``k * block_size`` tokens and part at the next token (a digit later only
  where two sibling ids are equal modulo the pool size, a few thousand);
- the rest (past the hash ids, or all of it when the trace has none) is unique to the
  request: one of the marker tokens, which no block starts with (so it never extends a
  shared prefix), chosen by the request key (so requests ``i`` and ``j`` part at once
  unless ``i = j`` modulo the number of markers), then the key spelled, then random
  tokens.

A prompt longer than the context is clipped by ``plan`` before it reaches here, so clipping
keeps the shared prefix.

Without the target's tokenizer (``approximate_pool``) the same layout is built from common
English words, one of which is about one token in most tokenizers: lengths are then
approximate and the report says so.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

_WORD = re.compile(r"^ [A-Za-z]{2,}$")
_SP_WORD = re.compile(r"^\u2581[A-Za-z]{2,}$")
_ID_DIGITS = 3
_MAX_POOL = 8192


class PromptError(ValueError):
    """The tokenizer cannot give exact synthetic prompts (or cannot be read)."""


@dataclasses.dataclass(frozen=True)
class TokenPool:
    """Token ids to build prompts from, and how to turn them into text.

    ``markers`` start every unique (non-shared) part and no block; ``digits`` are the other
    pool tokens; ``leading`` are the special tokens the tokenizer puts before a text prompt;
    ``exact`` says whether lengths are exact for the target model."""

    markers: tuple[int, ...]
    digits: tuple[int, ...]
    leading: tuple[int, ...]
    decode: Callable[[Sequence[int]], str]
    exact: bool = True
    chat_count: Callable[[str], int] | None = None


def _load(path: Path) -> tuple[Any, Any]:
    """The raw ``tokenizers.Tokenizer`` and, where the directory allows, meshserve's
    ``ModelTokenizer`` (for the chat template)."""
    from tokenizers import Tokenizer

    from shared.tokenization import ModelTokenizer

    path = Path(path)
    tok_file = path / "tokenizer.json" if path.is_dir() else path
    if not tok_file.is_file():
        raise PromptError(f"{path}: no tokenizer.json there")
    try:
        raw = Tokenizer.from_file(str(tok_file))
    except Exception as e:
        raise PromptError(f"{tok_file}: not a tokenizers JSON file: {e}") from e
    raw.no_truncation()
    raw.no_padding()
    try:
        model_tok = ModelTokenizer.from_dir(tok_file.parent)
    except Exception:
        model_tok = None
    return raw, model_tok


def tokenizer_pool(path: Path | str, *, seed: int = 0, need_text: bool = True) -> TokenPool:
    """The verified pool of the tokenizer at ``path`` (a model directory or tokenizer.json).
    With ``need_text=False`` (prompts sent as ids) a tokenizer whose words do not round-trip
    through text still serves: every ordinary token is then in the pool."""
    raw, model_tok = _load(Path(path))
    vocab = raw.get_vocab_size(with_added_tokens=True)
    added = set(raw.get_added_tokens_decoder())
    ids = [i for i in range(vocab) if i not in added]
    # Byte-level BPE decodes " river" alone; SentencePiece drops the leading space of a
    # lone token, so its word tokens are recognised by the "▁" of the token string.
    texts = raw.decode_batch([[i] for i in ids], skip_special_tokens=False)
    cands = [i for i, t in zip(ids, texts, strict=True) if _WORD.match(t)]
    if len(cands) < 64:
        cands = [i for i in ids if _SP_WORD.match(raw.id_to_token(i) or "")]
    if cands:
        singles = raw.encode_batch([raw.decode([i]) for i in cands], add_special_tokens=False)
        cands = [i for i, e in zip(cands, singles, strict=True) if e.ids == [i]]
    # In sequence: decode a shuffled run, re-encode it, and drop the pair where it first
    # comes back different, until it round-trips. In windows, so that a large vocabulary
    # costs little; the pool is capped (a few thousand words make plenty of prompts).
    rng = random.Random(seed)
    cands = cands[:_MAX_POOL]
    rng.shuffle(cands)
    seq: list[int] = []
    for w in range(0, len(cands), 512):
        window = cands[w : w + 512]
        for _ in range(len(window)):
            text = raw.decode(window, skip_special_tokens=False)
            back = raw.encode(text, add_special_tokens=False).ids
            if back == window:
                break
            k = next(
                (k for k, (a, b) in enumerate(zip(window, back, strict=False)) if a != b),
                min(len(window), len(back)),
            )
            del window[max(0, k - 1) : k + 1]
        else:
            window = []
        seq.extend(window)
    if (
        seq
        and raw.encode(raw.decode(seq, skip_special_tokens=False), add_special_tokens=False).ids
        != seq
    ):
        seq = []  # words that pass alone and in windows but merge across them: give up
    cands = sorted(seq)
    if len(cands) < 64 and not need_text:
        cands = ids
    if len(cands) < 64:
        raise PromptError(
            f"{path}: only {len(cands)} whole-word tokens that re-encode to "
            "themselves; exact text prompts need 64 (use --prompt-format ids)"
        )
    leading = tuple(raw.encode("", add_special_tokens=True).ids)

    def decode(seq: Sequence[int]) -> str:
        return raw.decode(list(seq), skip_special_tokens=False)

    chat_count = None
    if model_tok is not None and model_tok.has_chat_template:

        def chat_count(text: str) -> int:
            return len(
                model_tok.encode_chat(
                    [{"role": "user", "content": text}], add_generation_prompt=True
                )
            )

    m = _n_markers(len(cands))
    return TokenPool(
        markers=tuple(cands[:m]),
        digits=tuple(cands[m:]),
        leading=leading,
        decode=decode,
        exact=True,
        chat_count=chat_count,
    )


_COMMON_WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no will can more about other into some could them than then time these two may "
    "first only new very also after made like over such our even most state well through "
    "years where way much before must back good great year between down own people work "
    "long still both life same under last right another place found day world part number "
    "water house left country small home high end thought every light name city side land "
    "line point young power form course sense fact head money order story hand river music "
    "book night road door room market table water field plan paper issue model south north "
    "east west black white green blue red open close hold turn move play stand learn change"
).split()


def approximate_pool() -> TokenPool:
    """A pool of common English words, each about one token for most tokenizers; used when
    the target's tokenizer is not at hand. Lengths are approximate (``exact=False``)."""
    words = list(dict.fromkeys(_COMMON_WORDS))

    def decode(seq: Sequence[int]) -> str:
        return "".join(" " + words[i] for i in seq).lstrip()

    m = _n_markers(len(words))
    return TokenPool(
        markers=tuple(range(m)),
        digits=tuple(range(m, len(words))),
        leading=(),
        decode=decode,
        exact=False,
    )


def _n_markers(pool_size: int) -> int:
    return max(1, min(64, pool_size // 16))


def _spell(pool: TokenPool, value: int, n: int) -> list[int]:
    """``value`` in base ``len(digits)``, ``n`` digit tokens, least significant first."""
    base = len(pool.digits)
    out = []
    value %= base**n
    for _ in range(n):
        value, d = divmod(value, base)
        out.append(pool.digits[d])
    return out


def block_ids(pool: TokenPool, hash_id: int, block_size: int, seed: int = 0) -> list[int]:
    """The ``block_size`` tokens of hash id ``hash_id``: its spelling, then seeded noise."""
    head = _spell(pool, hash_id, min(_ID_DIGITS, block_size))
    rng = random.Random(f"{seed}/block/{hash_id}")
    return head + rng.choices(pool.digits, k=block_size - len(head))


def unique_ids(pool: TokenPool, key: str, n: int, seed: int = 0) -> list[int]:
    """``n`` tokens no other request has: a marker, the key's spelling, seeded noise. A
    numeric key picks the marker round-robin, so neighbouring requests part at once."""
    if n <= 0:
        return []
    rng = random.Random(f"{seed}/unique/{key}")
    value = int(key) if key.isdigit() else rng.getrandbits(48)
    marker = pool.markers[value % len(pool.markers)]
    head = [marker, *_spell(pool, value // len(pool.markers), _ID_DIGITS + 2)][:n]
    return head + rng.choices(pool.digits, k=n - len(head))


def content_ids(
    pool: TokenPool,
    n: int,
    hash_ids: Sequence[int],
    block_size: int,
    key: str,
    seed: int = 0,
    *,
    skip: int = 0,
) -> list[int]:
    """``n`` content tokens: the blocks of ``hash_ids`` (cut at ``n``), then a unique rest.
    The first block is ``skip`` tokens short: the room the leading specials take."""
    out: list[int] = []
    for i, h in enumerate(hash_ids):
        if len(out) >= n:
            break
        block = block_ids(pool, h, block_size, seed)
        if i == 0:
            block = block[: max(0, block_size - skip)]
        out.extend(block[: n - len(out)])
    out.extend(unique_ids(pool, key, n - len(out), seed))
    return out


def prompt_ids(
    pool: TokenPool,
    n: int,
    hash_ids: Sequence[int],
    block_size: int,
    key: str,
    seed: int = 0,
) -> list[int]:
    """The ``n`` token ids a server sees for the prompt: the tokenizer's leading specials,
    then content laid out so that block ``i`` covers positions ``[i*bs, (i+1)*bs)``."""
    lead = list(pool.leading[:n])
    return lead + content_ids(pool, n - len(lead), hash_ids, block_size, key, seed, skip=len(lead))


@dataclasses.dataclass(frozen=True)
class Prompt:
    """What goes into the request body, and how many prompt tokens the server should count
    (``None`` where it cannot be known, without a tokenizer)."""

    body: dict[str, Any]
    tokens: int | None


def make_prompt(
    pool: TokenPool,
    api: str,
    fmt: str,
    n: int,
    hash_ids: Sequence[int],
    block_size: int,
    key: str,
    seed: int = 0,
) -> Prompt:
    """The prompt part of the body for ``api`` (``completions`` or ``chat``) in ``fmt``
    (``text`` or ``ids``; chat is always text).

    ``ids`` sends ``prompt`` as a list of token ids (OpenAI's API allows it; meshserve and
    vLLM accept it): exact against any server with the same vocabulary. ``text`` sends the
    decoded ids, which re-encode to the same ids (leading specials included). ``chat`` wraps
    the text in one user message; the template's own tokens are subtracted (the template is
    read from the tokenizer's directory) and the content length corrected until the
    templated prompt has exactly ``n`` tokens."""
    ids = prompt_ids(pool, n, hash_ids, block_size, key, seed)
    if api == "completions":
        if fmt == "ids":
            if not pool.exact:
                raise PromptError("--prompt-format ids needs the target's --tokenizer")
            return Prompt({"prompt": ids}, n)
        content = ids[len(pool.leading) :] if n > len(pool.leading) else []
        return Prompt({"prompt": pool.decode(content)}, n if pool.exact else None)
    if api != "chat":
        raise ValueError(f"unknown api {api!r}")
    body = content_ids(pool, n, hash_ids, block_size, key, seed)
    if pool.chat_count is None:
        return Prompt({"messages": [{"role": "user", "content": pool.decode(body)}]}, None)
    overhead = pool.chat_count("")
    m = max(1, n - overhead)
    for _ in range(4):
        text = pool.decode(body[:m])
        got = pool.chat_count(text)
        if got == n or (m <= 1 and got > n):
            break
        m = max(1, m + n - got)
        if m > len(body):
            body = content_ids(pool, m, hash_ids, block_size, key, seed)
    text = pool.decode(body[:m])
    return Prompt({"messages": [{"role": "user", "content": text}]}, pool.chat_count(text))

"""Prompt synthesis: exact token counts under the target tokenizer, exact shared prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from devtools.modelgen import corpus_documents
from loadgen.prompts import (
    PromptError,
    approximate_pool,
    make_prompt,
    prompt_ids,
    tokenizer_pool,
)
from shared.tokenization import ModelTokenizer

LENGTHS = (1, 2, 3, 15, 16, 17, 31, 100, 511, 512, 513, 2000)


@pytest.fixture(scope="module")
def demo_tok(demo_tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(demo_tokenizer_dir)


@pytest.fixture(scope="module")
def demo_pool(demo_tokenizer_dir: Path):
    return tokenizer_pool(demo_tokenizer_dir)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("hash_ids", [(), (7,), (7, 8, 9)])
def test_text_prompts_have_exact_length(demo_pool, demo_tok, n: int, hash_ids) -> None:
    p = make_prompt(demo_pool, "completions", "text", n, hash_ids, 16, f"k{n}")
    # What the server does with a text prompt: encode with the tokenizer's specials (BOS).
    ids = demo_tok.encode(p.body["prompt"])
    assert len(ids) == n == p.tokens
    assert ids == prompt_ids(demo_pool, n, hash_ids, 16, f"k{n}")


@pytest.mark.parametrize("n", [1, 16, 100, 777])
def test_id_prompts_have_exact_length_and_start_like_text(demo_pool, n: int) -> None:
    p = make_prompt(demo_pool, "completions", "ids", n, (1, 2), 16, "x")
    assert len(p.body["prompt"]) == n == p.tokens
    assert p.body["prompt"][0] == demo_pool.leading[0]  # BOS, as a text prompt gets it


@pytest.mark.parametrize("block_size", [16, 512])
def test_shared_hash_ids_give_exactly_the_shared_prefix(demo_pool, demo_tok, block_size) -> None:
    bs = block_size
    n = 4 * bs + 5
    base = [10, 11, 12, 13, 14]
    cases = {  # other request's hash ids → shared tokens
        (10, 11, 12, 99, 98): 3 * bs,
        (10, 99, 12, 13, 14): 1 * bs,  # a later equal id does not extend the prefix
        (99, 11, 12, 13, 14): 0 if not demo_pool.leading else len(demo_pool.leading),
        (10, 11, 12, 13, 14): n,  # same ids, same length: the same prompt
    }
    a = demo_tok.encode(
        make_prompt(demo_pool, "completions", "text", n, base, bs, "a").body["prompt"]
    )
    for other, shared in cases.items():
        b = demo_tok.encode(
            make_prompt(demo_pool, "completions", "text", n, other, bs, "b").body["prompt"]
        )
        assert common_prefix(a, b) == shared, other


def test_prefix_survives_a_shorter_prompt_and_unique_tails_differ(demo_pool) -> None:
    a = prompt_ids(demo_pool, 100, (1, 2, 3, 4, 5, 6, 7), 16, "a")
    b = prompt_ids(demo_pool, 40, (1, 2, 3), 16, "b")  # clipped: a prefix of the same blocks
    assert a[:40] == b
    # Beyond the hash ids every request is its own (replay keys are request indexes).
    # They part at the first token past the blocks, or the second for keys equal modulo the
    # number of marker tokens.
    m = len(demo_pool.markers)
    tails = [prompt_ids(demo_pool, 60, (1, 2), 16, str(i)) for i in range(100)]
    assert [common_prefix(tails[0], t) for t in tails[1:]] == [
        32 if i % m else 33 for i in range(1, 100)
    ]
    # No ids: nothing but BOS shared.
    bare = [prompt_ids(demo_pool, 60, (), 16, str(i)) for i in range(m)]
    assert all(common_prefix(bare[0], t) == len(demo_pool.leading) for t in bare[1:])
    # A unique tail never continues another request's blocks.
    longer = prompt_ids(demo_pool, 60, (1, 2, 3), 16, "0")
    assert common_prefix(longer, tails[5]) == 32


def test_prompts_are_deterministic_and_seeded(demo_pool) -> None:
    a = prompt_ids(demo_pool, 300, (4, 5), 16, "k", seed=1)
    assert a == prompt_ids(demo_pool, 300, (4, 5), 16, "k", seed=1)
    assert a != prompt_ids(demo_pool, 300, (4, 5), 16, "k", seed=2)


@pytest.mark.parametrize("n", [12, 13, 50, 1000])
def test_chat_prompts_count_the_template(demo_pool, demo_tok, n: int) -> None:
    p = make_prompt(demo_pool, "chat", "text", n, (3,), 16, "c")
    got = demo_tok.encode_chat(p.body["messages"], add_generation_prompt=True)
    assert len(got) == p.tokens == n


def _sentencepiece_like(tmp_path: Path) -> Path:
    """A Metaspace ("▁word") BPE, the Llama 2 / Mistral kind: no leading-space tokens when
    decoded alone."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(
        corpus_documents(), trainers.BpeTrainer(vocab_size=800, special_tokens=["<unk>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_other_tokenizer_families(tmp_path: Path) -> None:
    path = _sentencepiece_like(tmp_path)
    pool = tokenizer_pool(path)  # a tokenizer.json file, not a directory
    raw = Tokenizer.from_file(str(path))
    for n in (1, 5, 64, 300):
        p = make_prompt(pool, "completions", "text", n, (1, 2), 16, "s")
        assert raw.encode(p.body["prompt"]).ids == prompt_ids(pool, n, (1, 2), 16, "s")


def test_tokenizer_without_text_round_trip(tmp_path: Path) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()  # no decoder: spaces are lost
    tok.train_from_iterator(
        corpus_documents(), trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(PromptError, match="prompt-format ids"):
        tokenizer_pool(tmp_path)
    pool = tokenizer_pool(tmp_path, need_text=False)  # ids still work
    assert len(make_prompt(pool, "completions", "ids", 50, (), 16, "k").body["prompt"]) == 50
    with pytest.raises(PromptError, match=r"no tokenizer\.json"):
        tokenizer_pool(tmp_path / "missing")


def test_approximate_pool_without_a_tokenizer() -> None:
    pool = approximate_pool()
    p = make_prompt(pool, "completions", "text", 200, (1, 2), 16, "k")
    assert p.tokens is None and len(p.body["prompt"].split()) == 200
    q = make_prompt(pool, "completions", "text", 200, (1, 3), 16, "j")
    assert p.body["prompt"].split()[:16] == q.body["prompt"].split()[:16]
    with pytest.raises(PromptError):
        make_prompt(pool, "completions", "ids", 10, (), 16, "k")

"""The generated checkpoints: reproducible, loadable by transformers, and shaped as promised."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devtools import modelgen

transformers = pytest.importorskip("transformers")


def _tree(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


def test_demo_generation_is_byte_identical(tmp_path: Path) -> None:
    a = modelgen.make_demo_model(tmp_path / "a", train_steps=3)
    b = modelgen.make_demo_model(tmp_path / "b", train_steps=3)
    assert _tree(a) == _tree(b)
    # Training changed the weights: the seed alone would not make a model that writes words.
    c = modelgen.make_demo_model(tmp_path / "c", train_steps=0)
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_other_seed_other_weights(tmp_path: Path) -> None:
    a = modelgen.make_demo_model(tmp_path / "a", train_steps=0, seed=0)
    b = modelgen.make_demo_model(tmp_path / "b", train_steps=0, seed=1)
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])


def test_demo_model_layout(demo_model_dir: Path) -> None:
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["max_position_embeddings"] >= 4096
    assert cfg["num_key_value_heads"] < cfg["num_attention_heads"]  # GQA
    tok_cfg = json.loads((demo_model_dir / "tokenizer_config.json").read_text())
    assert "add_generation_prompt" in tok_cfg["chat_template"]
    gen = json.loads((demo_model_dir / "generation_config.json").read_text())
    assert 3 in gen["eos_token_id"]  # <|im_end|> ends a chat turn
    # No lm_head tensor: tied embeddings, as real small checkpoints store them.
    assert "lm_head.weight" not in load_file(demo_model_dir / "model.safetensors")


def test_demo_model_runs_in_transformers(demo_model_dir: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir)
    tok = transformers.AutoTokenizer.from_pretrained(demo_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is free software?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)
    text = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    # The trained model writes words it saw, not byte soup.
    seen = [*modelgen.corpus_documents(), *(f"{q} {a}" for q, a in modelgen.dialogues())]
    corpus_words = set(re.findall(r"[A-Za-z]+", " ".join(seen)))
    words = re.findall(r"[A-Za-z]+", text)
    assert words, text
    assert sum(w in corpus_words for w in words) >= 0.8 * len(words), text


def test_training_model_is_transformers_llama(demo_model_dir: Path) -> None:
    """The trainer's own forward pass must be HF's, or training would fit another model."""
    cfg = json.loads((demo_model_dir / "config.json").read_text())
    tiny = modelgen.TinyLlama(cfg)
    tiny.load_state_dict(load_file(demo_model_dir / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir)
    ids = torch.randint(0, cfg["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(tiny(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_existing_model_is_reused_and_force_rebuilds(tmp_path: Path) -> None:
    out = modelgen.make_demo_model(tmp_path / "m", train_steps=0)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    modelgen.make_demo_model(out, train_steps=0)
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    modelgen.make_demo_model(out, train_steps=0, force=True)
    assert (out / "model.safetensors").stat().st_mtime_ns != stamp
    # Other arguments: the old model is stale and replaced.
    modelgen.make_demo_model(out, train_steps=1)
    assert json.loads((out / modelgen.STAMP_FILE).read_text())["train_steps"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_foreign_directory_is_not_clobbered(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        modelgen.make_demo_model(target, train_steps=0)
    assert (target / "notes.txt").read_text() == "mine"


def test_cli_writes_demo_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert modelgen.main(["demo", str(tmp_path / "d"), "--train-steps", "0"]) == 0
    assert Path(capsys.readouterr().out.strip()) == tmp_path / "d"
    assert (tmp_path / "d" / "model.safetensors").is_file()


def test_bench_config_is_qwen2_0_5b() -> None:
    cfg = modelgen.bench_config()
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    ) == (896, 4864, 24, 14, 2, 151936)
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 1_000_000.0
    assert cfg["max_position_embeddings"] >= 4096
    assert cfg["torch_dtype"] == "bfloat16"


def test_bench_tensors_are_what_transformers_expects() -> None:
    cfg = modelgen.bench_config()
    shapes = modelgen._tensor_shapes(cfg, qkv_bias=True)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**cfg))
    expected = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    assert shapes == expected
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 494_032_768  # Qwen2-0.5B


@pytest.mark.slow
def test_bench_model_generates_text(tmp_path: Path) -> None:
    out = modelgen.make_bench_model(tmp_path / "bench")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg == modelgen.bench_config()
    weights = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    del weights
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        logits = model(**ids).logits
    assert torch.isfinite(logits).all()
    new = model.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1] :]
    # Random weights, but every token is one the tokenizer can print and none ends the turn.
    assert all(4 <= t < tok.vocab_size for t in new.tolist())
    assert tok.decode(new).strip()

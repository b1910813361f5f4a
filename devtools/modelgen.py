"""Offline generation of the checkpoints meshserve runs without downloading anything.

* ``demo``: a tiny Llama (1.3 M parameters) with its own byte-level BPE tokenizer, trained
  for 20-30 s of CPU on the text in ``devtools/data`` so that it writes word-like text and ends
  its chat turns. Tests and local clusters use it; it loads in milliseconds.
* ``bench``: a Qwen2-0.5B-shaped checkpoint with random bf16 weights and the demo
  tokenizer, for throughput and memory benchmarks where only the shapes matter.

Both are written in the Hugging Face layout that ``transformers`` and the torch engine read.
Same arguments give the same bytes: the corpus is committed, the tokenizer trainer is
deterministic, every random draw comes from a seeded generator, and training runs on one
thread with deterministic algorithms. The tokenizer and the bench weights depend on nothing
else; the demo's trained weights also depend on the torch version and, in their last bits, on
the CPU's vector unit (an AVX2 and an AVX-512 matmul may round differently).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn

log = logging.getLogger(__name__)

# Bumped whenever the output of a generator changes, so that stale models get rebuilt.
GENERATOR_VERSION = 1
STAMP_FILE = "meshserve-modelgen.json"

BOS = "<|begin_of_text|>"
EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# The trainer numbers special tokens first, in this order: BOS=0, EOT=1, IM_START=2, IM_END=3.
SPECIAL_TOKENS = (BOS, EOT, IM_START, IM_END)
DEMO_VOCAB_SIZE = 4096

# Llama 3's pre-tokenizer split: words keep their leading space, digits group by three.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, with BOS in front as Llama 3 does. Content may be a string or a list of OpenAI-style
# parts, of which only the text parts are rendered.
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- elif message['content'] is iterable %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Small steps, many of them: for a model this size, 600 updates of 4 x 64 tokens learn far
# more than 200 of 8 x 128 in the same time (phrases instead of "the the the"). A step takes
# 30-50 ms on one core, so the demo model builds in 20-35 s.
DEFAULT_TRAIN_STEPS = 600
_TRAIN_BATCH = 4
_TRAIN_SEQ = 64
_TRAIN_LR = 3e-3
# The dialogues are 4 % of the text; repeating them teaches the chat format and <|im_end|>.
_DIALOGUE_REPEATS = 6


# --------------------------------------------------------------------------- configs


def demo_config(vocab_size: int = DEMO_VOCAB_SIZE) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": [3, 1],
        "pad_token_id": 1,
        "use_cache": True,
        "torch_dtype": "float32",
    }


def bench_config() -> dict[str, Any]:
    """The config.json of Qwen/Qwen2-0.5B-Instruct (32k context), except the special token
    ids, which point into the demo tokenizer."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "max_window_layers": 24,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": [3, 1],
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def _head_dim(cfg: dict[str, Any]) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _tensor_shapes(cfg: dict[str, Any], *, qkv_bias: bool) -> dict[str, tuple[int, ...]]:
    """Names and shapes as the HF Llama/Qwen2 checkpoints store them (no lm_head: tied)."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * _head_dim(cfg)
    kv = cfg["num_key_value_heads"] * _head_dim(cfg)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    shapes["model.norm.weight"] = (h,)
    return shapes


# --------------------------------------------------------------------------- corpus


def corpus_documents() -> list[str]:
    """The license texts, one document each (see devtools/data/README.md)."""
    text = resources.files("devtools").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    return [doc for doc in text.split(f"\n{EOT}\n") if doc.strip()]


def reflow(doc: str) -> str:
    """One line per paragraph, without the license texts' centring and indentation, which
    the tiny model would spend its few steps learning. Two spaces after a full stop stay:
    they are where it learns what follows a prompt that ends in a space."""
    paragraphs = (
        " ".join(line.strip() for line in p.splitlines() if line.strip())
        for p in doc.replace("\f", "\n").split("\n\n")
    )
    return "\n\n".join(p for p in paragraphs if p)


def dialogues() -> list[tuple[str, str]]:
    text = resources.files("devtools").joinpath("data/dialogues.txt").read_text(encoding="utf-8")
    pairs = []
    for block in text.strip().split("\n\n"):
        user, _, assistant = block.partition("\nAssistant: ")
        pairs.append((user.removeprefix("User: ").strip(), assistant.strip()))
    return pairs


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(vocab_size: int = DEMO_VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        # The corpus is small: allowing pairs seen once is what fills the vocabulary.
        min_frequency=1,
        show_progress=False,
    )
    texts = corpus_documents() + [f"{q}\n{a}" for q, a in dialogues()]
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tok


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out: Path, tok: Tokenizer, *, model_max_length: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    special = {"bos_token": BOS, "eos_token": IM_END, "pad_token": EOT}
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "added_tokens_decoder": added,
            **special,
            "clean_up_tokenization_spaces": False,
            "model_max_length": model_max_length,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(out / "special_tokens_map.json", special)


def _generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg.get("pad_token_id", 1),
    }


# --------------------------------------------------------------------------- tiny Llama


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, d = cfg["hidden_size"], _head_dim(cfg)
        self.n_heads, self.n_kv, self.head_dim = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            d,
        )
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = _RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = _MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = _RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class TinyLlama(nn.Module):
    """Just enough of LlamaForCausalLM (HF's math and parameter names) to train the demo
    model without depending on transformers, which is a dev-only dependency."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = _Body(cfg)
        d = _head_dim(cfg)
        self.inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2).float() / d))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)

    @torch.no_grad()
    def init_weights(self, gen: torch.Generator) -> None:
        std = self.cfg["initializer_range"]
        # Sorted names: the draw order must not depend on module construction order.
        for name, p in sorted(self.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)


# --------------------------------------------------------------------------- training


def _training_stream(tok: Tokenizer, gen: torch.Generator) -> torch.Tensor:
    """Every document once and the dialogues several times, as chats of one to three turns,
    in a seeded order."""
    bos, eot = tok.token_to_id(BOS), tok.token_to_id(EOT)

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def randint(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=gen))

    def doc_ids(doc: str) -> list[int]:
        out = [bos]
        for para in reflow(doc).split("\n\n"):
            spaces = [i for i, c in enumerate(para) if c == " "]
            # A prompt ending in a space ("The ") ends in a lone " " token, a split running
            # text never has; without examples of it the model just stops there.
            if spaces and randint(3) == 0:
                k = spaces[randint(min(len(spaces), 4) if randint(2) else len(spaces))] + 1
                out += ids(para[:k]) + ids(para[k:] + "\n\n")
            else:
                out += ids(para + "\n\n")
        return [*out, eot]

    docs = [doc_ids(d) for d in corpus_documents()]
    pairs = dialogues()
    for _ in range(_DIALOGUE_REPEATS):
        order = torch.randperm(len(pairs), generator=gen).tolist()
        while order:
            turns = 1 + randint(3)
            chat, order = order[:turns], order[turns:]
            text = ""
            if randint(2):
                text += f"{IM_START}system\n{DEFAULT_SYSTEM_PROMPT}{IM_END}\n"
            for i in chat:
                q, a = pairs[i]
                text += f"{IM_START}user\n{q}{IM_END}\n{IM_START}assistant\n{a}{IM_END}\n"
            docs.append([bos, *ids(text), eot])
    order = torch.randperm(len(docs), generator=gen).tolist()
    return torch.tensor([t for i in order for t in docs[i]], dtype=torch.long)


@contextlib.contextmanager
def _deterministic_torch() -> Iterator[None]:
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True)
    # One thread: CPU kernels may split reductions by thread count, and the 2-core CI box and
    # a 16-core GPU host must agree.
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev_det)
        torch.set_num_threads(prev_threads)


def train(
    model: TinyLlama,
    stream: torch.Tensor,
    *,
    steps: int,
    gen: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
) -> None:
    if steps <= 0:
        return
    opt = torch.optim.AdamW(
        model.parameters(), lr=_TRAIN_LR, betas=(0.9, 0.95), weight_decay=0.0, foreach=False
    )
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(frac * math.pi))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    span = _TRAIN_SEQ + 1
    model.train()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - span, (_TRAIN_BATCH,), generator=gen)
        batch = torch.stack([stream[s : s + span] for s in starts.tolist()])
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=False)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()


# --------------------------------------------------------------------------- output dirs


def _is_complete(path: Path) -> bool:
    return all(
        (path / f).is_file()
        for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    )


def _read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads((path / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _publish(
    out_dir: Path, stamp: dict[str, Any], force: bool, build: Callable[[Path], None]
) -> Path:
    """Builds into a sibling temp dir and renames it into place, so that a reader never sees
    half a model and an interrupted run leaves nothing behind at ``out_dir``."""
    out_dir = Path(out_dir).absolute()
    if out_dir.exists() and not force:
        found = _read_stamp(out_dir)
        if found == stamp and _is_complete(out_dir):
            log.info("model already generated at %s", out_dir)
            return out_dir
        if found is None and _is_complete(out_dir):
            # Not ours: someone put a checkpoint here; never clobber it without --force.
            log.info("a model not made by modelgen is at %s; keeping it", out_dir)
            return out_dir
        if found is None and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} holds something that is not a model; not touching it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build(tmp)
        _write_json(tmp / STAMP_FILE, stamp)
        # mkdtemp and safetensors create owner-only files; engines may run as other users.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
        old = None
        if out_dir.exists():
            if not force and _read_stamp(out_dir) == stamp and _is_complete(out_dir):
                return out_dir  # a concurrent generator finished first; keep what readers see
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            out_dir.rename(old)
        try:
            tmp.rename(out_dir)
        except OSError:
            # A concurrent generator won the race; its model is as good as ours.
            if not _is_complete(out_dir):
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def make_demo_model(
    out_dir: Path,
    *,
    train_steps: int = DEFAULT_TRAIN_STEPS,
    seed: int = 0,
    force: bool = False,
) -> Path:
    stamp = {
        "kind": "demo",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "train_steps": train_steps,
    }

    def build(tmp: Path) -> None:
        tok = train_tokenizer()
        cfg = demo_config(tok.get_vocab_size())
        gen = torch.Generator().manual_seed(seed)
        with _deterministic_torch():
            model = TinyLlama(cfg)
            model.init_weights(gen)
            train(model, _training_stream(tok, gen), steps=train_steps, gen=gen)
        tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", _generation_config(cfg))
        write_tokenizer_files(tmp, tok, model_max_length=cfg["max_position_embeddings"])

    return _publish(out_dir, stamp, force, build)


# Std of the embedding rows of real tokens. With tied embeddings the logit scale is about
# std * sqrt(hidden) ≈ 4.5, so sampling and argmax land on tokens the tokenizer can decode
# instead of the 148k ids past its end, whose rows are near zero like a real model's unused
# rows. Special tokens get near-zero rows too, so a benchmark's generations run to max_tokens.
_BENCH_TOKEN_STD = 0.15
_BENCH_UNUSED_STD = 1e-3
_BENCH_STD = 0.02


def bench_weights(cfg: dict[str, Any], *, seed: int, real_vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in _tensor_shapes(cfg, qkv_bias=True).items():
        # Drawn straight into bf16: no fp32 copy of the half-billion parameters.
        t = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith(".bias"):
            t.normal_(0.0, _BENCH_STD, generator=gen)
        elif name == "model.embed_tokens.weight":
            t.normal_(0.0, _BENCH_UNUSED_STD, generator=gen)
            t[len(SPECIAL_TOKENS) : real_vocab].normal_(0.0, _BENCH_TOKEN_STD, generator=gen)
        else:
            t.normal_(0.0, _BENCH_STD, generator=gen)
        out[name] = t
    return out


def make_bench_model(out_dir: Path, *, seed: int = 0, force: bool = False) -> Path:
    stamp = {"kind": "bench", "generator_version": GENERATOR_VERSION, "seed": seed}

    def build(tmp: Path) -> None:
        tok = train_tokenizer()
        cfg = bench_config()
        tensors = bench_weights(cfg, seed=seed, real_vocab=tok.get_vocab_size())
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", cfg)
        _write_json(tmp / "generation_config.json", _generation_config(cfg))
        write_tokenizer_files(tmp, tok, model_max_length=cfg["max_position_embeddings"])

    return _publish(out_dir, stamp, force, build)


# --------------------------------------------------------------------------- CLI


def _default_dir(name: str) -> Path:
    from shared.settings import Settings

    return Settings.load().models_dir / name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m devtools.modelgen", description=__doc__)
    sub = parser.add_subparsers(dest="kind", required=True)
    demo = sub.add_parser("demo", help="tiny trained Llama with its own tokenizer")
    demo.add_argument("dir", nargs="?", type=Path, default=None)
    demo.add_argument("--train-steps", type=int, default=DEFAULT_TRAIN_STEPS)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--force", action="store_true", help="rebuild even if already there")
    bench = sub.add_parser("bench", help="Qwen2-0.5B-shaped random bf16 weights")
    bench.add_argument("dir", nargs="?", type=Path, default=None)
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--force", action="store_true", help="rebuild even if already there")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    t0 = time.perf_counter()
    if args.kind == "demo":
        out = make_demo_model(
            args.dir or _default_dir("demo"),
            train_steps=args.train_steps,
            seed=args.seed,
            force=args.force,
        )
    else:
        out = make_bench_model(
            args.dir or _default_dir("bench-qwen2-0.5b"), seed=args.seed, force=args.force
        )
    print(f"{out} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

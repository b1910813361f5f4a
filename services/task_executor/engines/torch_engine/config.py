"""What the torch engine needs to know about a checkpoint, read from its HF config files.

Llama, Qwen2 and Mistral share one decoder shape (pre-norm RMSNorm, RoPE, GQA attention,
SwiGLU MLP); they differ only in the fields parsed here. Both the transformers 4.x layout
(``rope_theta`` + ``rope_scaling``) and the 5.x one (``rope_parameters``) are accepted.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


@dataclasses.dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    type: str = "default"  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int | None = None  # llama3 only


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 always has q/k/v bias; Llama/Mistral only if the config says so
    torch_dtype: str | None  # the dtype the checkpoint was saved in ("bfloat16", ...)
    eos_token_ids: frozenset[int]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open() as f:
        return json.load(f)


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 folds rope_theta into rope_parameters; 4.x keeps them apart and calls the
    # scaling dict rope_scaling (whose type key was "type" before it became "rope_type").
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r} (supported: {sorted(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    factor = float(params["factor"])
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=factor)
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=factor,
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


def load_model_config(model_dir: Path | str) -> ModelConfig:
    model_dir = Path(model_dir)
    raw = _read_json(model_dir / "config.json")
    if not raw:
        raise FileNotFoundError(f"no config.json in {model_dir}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} (supported: {sorted(SUPPORTED_MODEL_TYPES)})"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}: the MLP is SwiGLU")
    if raw.get("mlp_bias"):
        raise ValueError("unsupported: mlp_bias")
    # Sliding-window attention (Mistral v0.1, Qwen2 with use_sliding_window) is ignored: every
    # layer attends to the whole context. That is exact while sequences stay shorter than the
    # window (4096+ tokens for those models) and an approximation beyond it.

    num_heads = int(raw["num_attention_heads"])
    hidden_size = int(raw["hidden_size"])
    eos = _token_ids(raw.get("eos_token_id"))
    eos |= _token_ids(_read_json(model_dir / "generation_config.json").get("eos_token_id"))
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or hidden_size // num_heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        vocab_size=int(raw["vocab_size"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=frozenset(eos),
    )

"""The model registry: every Hugging Face checkpoint directory under MESHSERVE_MODELS_DIR."""

from __future__ import annotations

import json
from pathlib import Path

from shared.messages.cluster import ModelInfo

_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")


def read_model(path: Path) -> ModelInfo | None:
    """The registry entry of one checkpoint, or None if path holds no complete one."""
    cfg_path = path / "config.json"
    has_weights = (path / "model.safetensors").exists() or (
        path / "model.safetensors.index.json"
    ).exists()
    if not cfg_path.is_file() or not has_weights or not (path / "tokenizer.json").exists():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    context = next((int(cfg[k]) for k in _CONTEXT_KEYS if k in cfg), 2048)
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown")])[0]
    return ModelInfo(
        id=path.name,
        path=str(path.resolve()),
        architecture=arch,
        max_context=context,
        created=int(cfg_path.stat().st_mtime),
    )


def scan_models(models_dir: Path) -> list[ModelInfo]:
    if not models_dir.is_dir():
        return []
    found = (read_model(p) for p in sorted(models_dir.iterdir()) if p.is_dir())
    return [m for m in found if m is not None]

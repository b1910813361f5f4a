"""Rotary position embedding tables, computed the way transformers computes them so that the
runner's logits match the reference to float32 precision."""

from __future__ import annotations

import math

import torch

from services.task_executor.engines.torch_engine.config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if rope.type == "linear":
        return freq / rope.factor
    if rope.type == "llama3":
        return _llama3(freq, rope)
    return freq


def _llama3(freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Llama 3.1: long wavelengths are stretched by `factor`, short ones kept, and the band in
    # between interpolated smoothly.
    assert rope.original_max_position_embeddings is not None
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_tables(
    rope: RopeConfig, head_dim: int, max_len: int, *, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos``/``sin`` as ``[max_len, head_dim]`` (each frequency twice, rotate-half layout),
    computed in float32 and then cast, as transformers does."""
    positions = torch.arange(max_len, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq(rope, head_dim)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype=dtype, device=device), emb.sin().to(dtype=dtype, device=device)

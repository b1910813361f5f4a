"""Token choice and stop rules.

Seeded sampling must not depend on which other requests share the batch. Each request owns a
``torch.Generator`` and draws exactly one uniform number from it per token; the token is then
found by inverse-CDF over that request's own row of probabilities. The batched tensor work
(softmax, sort, cumsum) is row-wise, so a row's result is the same alone or in any batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Sequence

import torch

from services.task_executor.engines.torch_engine.model import to_device
from shared.messages.api import SamplingParams


def make_generator(seed: int | None) -> torch.Generator:
    # On the host whatever the model's device: one draw per token is too small to be worth a
    # device generator, and host draws are the same on every device.
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else secrets.randbits(63))
    return g


def validate(params: SamplingParams) -> None:
    if params.max_tokens < 1:
        raise ValueError("max_tokens must be at least 1")
    if params.temperature < 0:
        raise ValueError("temperature must be >= 0")
    if not 0 < params.top_p <= 1:
        raise ValueError("top_p must be in (0, 1]")


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[int]:
    """One token per row of ``logits`` ``[batch, vocab]`` (float32)."""
    uniforms = [draw(g) for p, g in zip(params, generators, strict=True) if p.temperature != 0]
    return sample_tokens(logits, params, uniforms).tolist()


def draw(generator: torch.Generator) -> torch.Tensor:
    """The one uniform a sampled token costs its request's generator."""
    return torch.rand(1, generator=generator)


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: Sequence[torch.Tensor]
) -> torch.Tensor:
    """One token per row of ``logits`` ``[batch, vocab]`` (float32), as an int64 tensor on the
    logits' device: nothing waits for the device, so the next forward can be launched behind
    this one. ``uniforms``: a ``draw`` for each row with temperature != 0, in row order."""
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    random = [i for i, p in enumerate(params) if p.temperature != 0]
    if not random:
        return logits.argmax(dim=-1)
    device = logits.device
    draws = dict(zip(random, uniforms, strict=True))
    # Rows with and without top_p take different arithmetic (inverse CDF over sorted or over
    # unsorted probabilities, which pick different tokens for the same draw), so each group is
    # sampled on its own: a row's token never depends on which other rows share the batch.
    groups = [
        rows
        for rows in (
            greedy,
            [i for i in random if params[i].top_p < 1],
            [i for i in random if params[i].top_p >= 1],
        )
        if rows
    ]
    if len(groups) == 1:  # all sampled, one kind: no gather
        return _sample_rows(logits, list(params), list(uniforms))
    tokens = torch.empty(len(params), dtype=torch.long, device=device)
    for rows in groups:
        index = to_device(rows, torch.long, device)
        part = logits.index_select(0, index)
        if rows is greedy:
            picked = part.argmax(dim=-1)
        else:
            picked = _sample_rows(part, [params[i] for i in rows], [draws[i] for i in rows])
        tokens.index_copy_(0, index, picked)
    return tokens


def _sample_rows(
    logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: list[torch.Tensor]
) -> torch.Tensor:
    device = logits.device
    temps = to_device([p.temperature for p in params], logits.dtype, device)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    u = torch.cat(uniforms)
    u = u.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else u.to(device)
    if all(p.top_p >= 1 for p in params):
        order = None
    else:
        probs, order = probs.sort(dim=-1, descending=True)
        top_p = to_device([p.top_p for p in params], probs.dtype, device)
        # Keep the smallest prefix whose mass reaches top_p: a token stays if the mass before
        # it is still short of top_p (so the most likely token always stays).
        before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(before >= top_p[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    # right=True picks the first token whose cdf exceeds u, which never lands on a token of
    # zero probability (its cdf equals its predecessor's).
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
    idx = idx.clamp_(max=cdf.shape[-1] - 1)
    if order is not None:
        idx = order.gather(-1, idx)
    return idx.squeeze(-1)


def finish_reason(
    token: int,
    *,
    num_output_tokens: int,
    num_tokens: int,
    params: SamplingParams,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> str | None:
    """Why a request stops after emitting ``token`` (already counted), or None to go on."""
    if token in params.stop_token_ids or (not params.ignore_eos and token in eos_token_ids):
        return "stop"
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None

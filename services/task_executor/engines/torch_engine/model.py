"""The decoder forward over the paged KV cache (Llama / Qwen2 / Mistral).

One forward runs a whole iteration: the new tokens of every scheduled request are flattened into
one ``[num_tokens, hidden]`` batch, so each weight matrix is read once per iteration however many
requests share it. Only attention is per request:
- decode requests (one new token each) attend together: on CPU a C kernel reads their blocks
  in place (``cpu_kernels.py``); elsewhere their blocks are gathered into a padded
  ``[batch, kv_heads, max_len, head_dim]`` K/V and the query heads that share a K/V head are
  laid out as that head's query rows, so GQA needs no K/V repetition;
- prefill requests attend one at a time, causally (``attention.py``), over their own fresh K/V
  (or over the cache when part of the sequence is already there, which chunked prefill and
  prefix caching need).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from services.task_executor.engines.torch_engine.attention import (
    additive_mask,
    causal_attention,
    gathered_decode_attention,
    sdpa_is_fastest,
)
from services.task_executor.engines.torch_engine.config import ModelConfig
from services.task_executor.engines.torch_engine.cpu_kernels import (
    DEFAULT_TOOLCHAIN,
    Toolchain,
    causal_softmax,
    decode_attention,
    elementwise,
    prefill_attention,
)
from services.task_executor.engines.torch_engine.cuda_graphs import DecodeGraphs
from services.task_executor.engines.torch_engine.kv_cache import PagedKVCache
from services.task_executor.engines.torch_engine.linear import linear
from services.task_executor.engines.torch_engine.lora import (
    AdapterSlots,
    LoraSelection,
    batch_slots,
)
from services.task_executor.engines.torch_engine.rope import cos_sin_tables
from services.task_executor.engines.torch_engine.weights import ModelWeights


@dataclasses.dataclass(frozen=True, slots=True)
class SeqChunk:
    """The tokens one request computes in an iteration."""

    token_ids: Sequence[int]
    start_pos: int  # tokens of this request already in the cache
    block_table: Sequence[int]  # covers start_pos + len(token_ids) tokens


@dataclasses.dataclass(frozen=True, slots=True)
class _Prefill:
    q_start: int
    q_len: int
    start_pos: int
    block_table: torch.Tensor | None  # only when start_pos > 0: the cached part is read back


@dataclasses.dataclass(frozen=True, slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] flat cache slot of each token
    logits_indices: torch.Tensor  # [S] last token of each sampled request, in the caller's order
    num_decode: int  # the first num_decode tokens (and requests) are single-token decodes
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_lens: torch.Tensor | None  # [D] tokens each decode request attends to
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks * block_size], True = attend
    prefills: tuple[_Prefill, ...]
    # called with each layer's index once its K/V are in the cache (kv_stream.layer_hook)
    on_layer: Callable[[int], None] | None = None
    # each token's LoRA adapter slot (lora.py); None when no request of the batch has one
    lora: LoraSelection | None = None


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A small host list as a tensor on ``device``. On CUDA the copy goes through pinned memory
    and does not block: a plain copy synchronizes the stream, which would wait for a forward
    still running (the overlapped engine launches the next iteration behind it)."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def build_batch(
    chunks: Sequence[SeqChunk],
    *,
    block_size: int,
    device: torch.device,
    input_ids: torch.Tensor | None = None,
    sampled: Sequence[bool] | None = None,
    adapter_slots: Sequence[int] | None = None,
) -> ForwardBatch:
    """Lay out an iteration's requests: decodes first (they attend as one batch), then
    prefills. Logits still come back in the order of ``chunks``: for each chunk, or, with
    ``sampled``, for each chunk marked True (a prompt chunk that is not the prompt's last
    needs none).

    ``input_ids``: the tokens as a device tensor, in the order of ``chunks``, instead of their
    ``token_ids`` (only for single-token chunks, whose token ids are then ignored): a decode
    step can start from tokens sampled on the device without waiting for them on the host.

    ``adapter_slots``: each chunk's LoRA adapter slot (-1: none), or None when no chunk has
    one (then the forward computes no LoRA at all).

    Every integer the batch needs crosses to the device in one copy."""
    decode = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1]
    prefill = [i for i, c in enumerate(chunks) if len(c.token_ids) != 1]
    if input_ids is not None and prefill:
        raise ValueError("input_ids replaces the tokens of single-token chunks only")
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_slots: list[int] = []  # each token's adapter slot, with adapter_slots
    last = [0] * len(chunks)
    # (q_start, q_len, start_pos, offset of its block table in `tail` or -1, table length)
    prefill_specs: list[tuple[int, int, int, int, int]] = []
    tail: list[int] = []  # decode block tables, decode context lengths, prefill block tables
    for i in decode + prefill:
        c = chunks[i]
        n = len(c.token_ids)
        pos = range(c.start_pos, c.start_pos + n)
        if n != 1:
            prefill_specs.append((len(positions), n, c.start_pos, -1, len(c.block_table)))
        if input_ids is None:
            ids.extend(c.token_ids)
        positions.extend(pos)
        slots.extend(c.block_table[p // block_size] * block_size + p % block_size for p in pos)
        if adapter_slots is not None:
            token_slots.extend([adapter_slots[i]] * n)
        last[i] = len(positions) - 1

    if sampled is not None:
        last = [pos for pos, keep in zip(last, sampled, strict=True) if keep]

    width = max((len(chunks[i].block_table) for i in decode), default=0)
    for i in decode:
        table = chunks[i].block_table
        tail.extend(table)
        tail.extend([0] * (width - len(table)))
    tail.extend(chunks[i].start_pos + 1 for i in decode)
    for k, (q_start, n, start_pos, _, table_len) in enumerate(prefill_specs):
        if start_pos:  # only then is the cached part read back
            prefill_specs[k] = (q_start, n, start_pos, len(tail), table_len)
            tail.extend(chunks[prefill[k]].block_table)

    used = batch_slots(adapter_slots) if adapter_slots is not None else ()
    head = [ids, positions, slots, last, token_slots if used else []]
    n_head = sum(len(part) for part in head)
    flat = to_device([v for part in head for v in part] + tail, dtype=torch.long, device=device)
    t_ids, t_pos, t_slots, t_last, t_lora = flat[:n_head].split([len(part) for part in head])
    rest = flat[n_head:]
    d = len(decode)
    tables = ctx = mask = None
    if d:
        tables = rest[: d * width].view(d, width)
        ctx = rest[d * width : d * width + d]
        valid = torch.arange(width * block_size, device=device)[None, :] < ctx[:, None]
        mask = valid[:, None, None, :]
    prefills = tuple(
        _Prefill(q_start, n, start_pos, rest[off : off + table_len] if off >= 0 else None)
        for q_start, n, start_pos, off, table_len in prefill_specs
    )
    return ForwardBatch(
        input_ids=t_ids if input_ids is None else input_ids,
        positions=t_pos,
        slots=t_slots,
        logits_indices=t_last,
        num_decode=d,
        decode_block_tables=tables,
        decode_lens=ctx,
        decode_mask=mask,
        prefills=prefills,
        lora=LoraSelection(t_lora, used) if used else None,
    )


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        # One fused kernel (float32 statistics too) instead of six: a decode step of a small
        # model is mostly small kernels, and they cost their time even replayed from a graph.
        return F.rms_norm(x, weight.shape, weight, eps)
    # float32 statistics whatever the model dtype, cast back before the weight: the reference's
    # rounding order, which keeps bf16 outputs close to it.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class Transformer:
    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        *,
        max_model_len: int,
        dtype: torch.dtype,
        device: torch.device,
        cpu_kernels: bool = True,
        toolchain: Toolchain = DEFAULT_TOOLCHAIN,
    ) -> None:
        """``cpu_kernels``: attention and the position-wise steps in meshserve's C kernels on
        CPU where they compile (with ``toolchain``) and take the model's dtype and shape;
        False keeps torch's ops everywhere."""
        self.config = config
        self.weights = weights
        self.device = device
        self.dtype = dtype
        self.cos, self.sin = cos_sin_tables(
            config.rope, config.head_dim, max_model_len, dtype=dtype, device=device
        )
        kernel_shape = {
            "num_heads": config.num_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
        }
        self.decode_kernel = (
            decode_attention(dtype=dtype, device=device, toolchain=toolchain, **kernel_shape)
            if cpu_kernels
            else None
        )
        self.elementwise = (
            elementwise(dtype=dtype, device=device, toolchain=toolchain) if cpu_kernels else None
        )
        # Prefill attention: meshserve's AMX kernel where it runs, else torch's SDPA where that
        # is the fastest (attention.py), else the blocked path.
        self.prefill_kernel = (
            prefill_attention(dtype=dtype, device=device, toolchain=toolchain, **kernel_shape)
            if cpu_kernels
            else None
        )
        self.prefill_sdpa = sdpa_is_fastest(device)
        self.prefill_softmax = (
            causal_softmax(dtype=dtype, device=device, toolchain=toolchain)
            if cpu_kernels and not self.prefill_sdpa
            else None
        )
        self.graphs: DecodeGraphs | None = None  # set by the engine on CUDA
        # The LoRA adapters' device slots, set by an engine that serves adapters; only a
        # batch with a LoRA selection reads them.
        self.lora: AdapterSlots | None = None

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        """Runs the batch, writes its K/V into ``cache`` and returns float32 logits
        ``[num_requests, vocab]`` of each request's last token. A decode batch replays a CUDA
        graph where ``graphs`` is set (``cuda_graphs.py``)."""
        if self.graphs is not None and self.graphs.covers(batch):
            return self.graphs.run(batch, cache)
        return self.forward_eager(batch, cache)

    @torch.inference_mode()
    def forward_eager(self, batch: ForwardBatch, cache: PagedKVCache) -> torch.Tensor:
        cfg, w = self.config, self.weights
        n_tokens = batch.input_ids.shape[0]
        n_heads, n_kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        rotate = self._rotation(batch.positions)

        # The decode mask as an additive bias, once per forward (unless the kernel runs).
        decode_bias = None
        if batch.decode_mask is not None and self.decode_kernel is None:
            decode_bias = additive_mask(batch.decode_mask, self.dtype)

        # LoRA: each targeted matrix's output gets its tokens' adapters' deltas (lora.py),
        # with the token mask built once here; without adapters in the batch, nothing.
        lora = None
        if batch.lora is not None:
            assert self.lora is not None, "a LoRA batch for a runner without adapter slots"
            lora = self.lora.plan(batch.lora)

        h = F.embedding(batch.input_ids, w.embed)
        delta = None  # the last MLP's output, added to h by the next norm
        for i, lw in enumerate(w.layers):
            x = self._add_norm(h, delta, lw.input_norm)
            qkv = linear(x, lw.qkv, lw.qkv_bias)
            if lora is not None:
                lora.add(i, "qkv", x, qkv)
            qkv = qkv.view(n_tokens, n_heads + 2 * n_kv, hd)
            q, k = rotate(qkv[:, : n_heads + n_kv])
            q, k, v = q[:, :n_heads], k[:, n_heads:], qkv[:, n_heads + n_kv :]
            cache.write(i, batch.slots, k, v)
            if batch.on_layer is not None:
                batch.on_layer(i)
            attn = self._attention(i, batch, cache, q, k, v, decode_bias)
            o = linear(attn, lw.o)
            if lora is not None:
                lora.add(i, "o", attn, o)
            x = self._add_norm(h, o, lw.post_norm)
            gate_up = linear(x, lw.gate_up)
            if lora is not None:
                lora.add(i, "gate_up", x, gate_up)
            act = self._silu_mul(gate_up)
            delta = linear(act, lw.down)
            if lora is not None:
                lora.add(i, "down", act, delta)
        last = batch.logits_indices
        h = self._add_norm(h[last], None if delta is None else delta[last], w.norm)
        return linear(h, w.lm_head).float()

    def _add_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> torch.Tensor:
        """``h += delta`` in place (the residual), then RMSNorm of ``h``."""
        if self.elementwise is not None:
            return self.elementwise.add_rms_norm(h, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            h += delta
        return _rms_norm(h, weight, self.config.rms_norm_eps)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.elementwise is not None:
            return self.elementwise.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _rotation(
        self, positions: torch.Tensor
    ) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """How this forward rotates a layer's q and k heads ``[T, heads + kv_heads, hd]``:
        returns (q, k) to slice the heads from (in place where the kernel runs)."""
        ew = self.elementwise
        if ew is not None:

            def in_place(qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                ew.rope_(qk, positions, self.cos, self.sin)
                return qk, qk

            return in_place
        # [T, 1, hd]: broadcast over the q and k heads, which are rotated together.
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        half = self.config.head_dim // 2

        def rotated(qk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            turned = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
            out = qk * cos + turned * sin
            return out, out

        return rotated

    def _attention(
        self,
        layer: int,
        batch: ForwardBatch,
        cache: PagedKVCache,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        decode_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """q ``[T, heads, hd]``, k/v ``[T, kv_heads, hd]`` -> ``[T, heads * hd]``."""
        outs = []
        d = batch.num_decode
        if d and self.decode_kernel is not None:
            assert batch.decode_block_tables is not None and batch.decode_lens is not None
            outs.append(
                self.decode_kernel(
                    q[:d],
                    cache.k[layer],
                    cache.v[layer],
                    batch.decode_block_tables,
                    batch.decode_lens,
                )
            )
        elif d:
            assert batch.decode_block_tables is not None and decode_bias is not None
            ck, cv = cache.gather(layer, batch.decode_block_tables)
            outs.append(gathered_decode_attention(q[:d], ck, cv, decode_bias))
        for p in batch.prefills:
            sl = slice(p.q_start, p.q_start + p.q_len)
            if p.block_table is None:
                kp, vp = k[sl], v[sl]
            else:  # part of the sequence is in the cache already: read all of it back
                kp, vp = cache.gather_tokens(layer, p.block_table, p.start_pos + p.q_len)
            if self.prefill_kernel is not None:
                outs.append(self.prefill_kernel(q[sl], kp, vp, p.start_pos))
                continue
            outs.append(
                causal_attention(
                    q[sl], kp, vp, p.start_pos, self.prefill_softmax, sdpa=self.prefill_sdpa
                )
            )
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)

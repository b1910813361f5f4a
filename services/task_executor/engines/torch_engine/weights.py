"""Load an HF safetensors checkpoint into the runner's layout.

q/k/v projections are concatenated into one matrix and gate/up into another at load time, so
a layer runs three matmuls on its input instead of five.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from services.task_executor.checkpoint import shard_files
from services.task_executor.engines.capabilities import TensorSource
from services.task_executor.engines.torch_engine import linear
from services.task_executor.engines.torch_engine.config import ModelConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None  # [(heads + 2 * kv_heads) * head_dim]
    o: torch.Tensor  # [hidden, heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclasses.dataclass(slots=True)
class ModelWeights:
    """Matrices (everything multiplied with ``linear.linear``) may be packed for the device;
    ``embed`` is always plain, since it is indexed."""

    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; when tied, embed's values (its packed copy on CPU)

    def swap(self, replacements: Mapping[int, torch.Tensor]) -> int:
        """Every tensor whose ``id`` is a key of ``replacements`` replaced by its value (the
        host cache's mapping of the same values); how many were replaced."""
        n = 0
        owners: list[Any] = [self, *self.layers]
        for owner in owners:
            for f in dataclasses.fields(owner):
                new = replacements.get(id(getattr(owner, f.name)))
                if new is not None:
                    setattr(owner, f.name, new)
                    n += 1
        return n

    def decode_bytes(self) -> int:
        """Bytes of weights one decode step streams: every matrix, norm and bias, and the LM
        head; the embedding table only contributes the rows looked up, ignored here."""
        tensors = [self.norm, self.lm_head]
        for layer in self.layers:
            fields = (getattr(layer, f.name) for f in dataclasses.fields(layer))
            tensors.extend(t for t in fields if t is not None)
        return sum(t.numel() * t.element_size() for t in tensors)


class CheckpointTensors:
    """Every shard of a checkpoint behind one name -> tensor lookup (memory-mapped reads): the
    ``TensorSource`` a TorchEngine reads when it is handed none."""

    def __init__(self, model_dir: Path) -> None:
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, Any] = {}
        for path in shard_files(model_dir):
            handle = safe_open(str(path), framework="pt", device="cpu")
            self._handles[path] = handle
            self._where.update(dict.fromkeys(handle.keys(), path))

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        tensor: torch.Tensor = self._handles[self._where[name]].get_tensor(name)
        return tensor


class DerivedTensors(Protocol):
    """Where the engine's own tensors may already be, made (``weight_cache.CacheSession``):
    the tensor made from checkpoint tensors ``sources`` as ``form`` says, or ``build()``."""

    def tensor(
        self, sources: Sequence[str], form: str, build: Callable[[], torch.Tensor]
    ) -> torch.Tensor: ...


def load_weights(
    tensors: TensorSource,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    derived: DerivedTensors | None = None,
) -> ModelWeights:
    """The runner's weights from a checkpoint's tensors (``CheckpointTensors(model_dir)``, or
    any other ``TensorSource`` with the checkpoint's names). With ``derived`` (the host
    cache), each of them is first looked up there, in the form this host's engine uses:
    cast and fused on the host, and packed for oneDNN where matrices are; a tensor for a
    GPU is then copied to the device once."""
    ckpt = tensors
    packed = linear.can_pack(dtype, device)
    plain_form = f"{dtype}|fused"
    matrix_form = linear.packed_form(dtype) if packed else plain_form
    if dtype == torch.bfloat16 and device.type == "cpu" and not packed:
        log.warning(
            "this CPU has no bf16 matrix support in oneDNN (AVX2 only): bf16 matmuls fall back "
            "to a slow path (on a 2-core AVX2 host, 6-10x slower than float32 from 8 tokens "
            "up); dtype float32 (or auto) runs faster here"
        )

    def on_host(*names: str) -> torch.Tensor:
        # Concatenate on the host in the target dtype, then move once: the device never holds
        # the unfused copies.
        parts = [ckpt.get(n).to(dtype) for n in names]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return t.contiguous()

    def made(names: Sequence[str], form: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
        if derived is None:
            return build()
        return derived.tensor(names, form, build)

    def load(*names: str) -> torch.Tensor:
        return made(names, plain_form, lambda: on_host(*names)).to(device)

    def load_matrix(*names: str) -> torch.Tensor:
        if packed:
            return made(names, matrix_form, lambda: linear.pack(on_host(*names)))
        return load(*names)

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=load(p + "input_layernorm.weight"),
                qkv=load_matrix(
                    attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"
                ),
                qkv_bias=(
                    load(attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")
                    if config.attention_bias
                    else None
                ),
                o=load_matrix(attn + "o_proj.weight"),
                post_norm=load(p + "post_attention_layernorm.weight"),
                gate_up=load_matrix(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=load_matrix(p + "mlp.down_proj.weight"),
            )
        )
    embed = load("model.embed_tokens.weight")
    # Tied exports may still carry a copy of lm_head.weight; the flag decides. A checkpoint
    # without one is tied whatever its config says (the flag's default differs by family).
    tied = config.tie_word_embeddings or "lm_head.weight" not in ckpt
    if tied:
        # On CPU, embed is on the host in the dtype already: packed as it is.
        name = "model.embed_tokens.weight"
        lm_head = made([name], matrix_form, lambda: linear.pack(embed)) if packed else embed
    else:
        lm_head = load_matrix("lm_head.weight")
    return ModelWeights(embed=embed, layers=layers, norm=load("model.norm.weight"), lm_head=lm_head)

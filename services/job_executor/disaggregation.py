"""Whether a request's prompt runs on a prefill instance (PD disaggregation), decided per
request after its decode instance is chosen. Pure: the services and the simulator call
``decide``.

Disaggregation does not raise throughput; it keeps long prefills from stalling the decode
iterations of other requests (TPOT), at the price of moving the prompt's KV. It pays for
long prompts the decode instance does not already hold, so the rule looks at the prompt
tokens *that instance* lacks (NVIDIA Dynamo's conditional disaggregation, llm-d's
``nonCachedTokens``): a prompt prefills locally when the uncached part is short
(``min_uncached_tokens``) or a small share of the prompt (``min_uncached_ratio``: mostly
cached), or when the prefill instances are backed up (``max_prefill_queue_tokens``: the
decode instance would start sooner on its own). ``always`` disaggregates whenever a prefill
instance is ready; ``never`` never does. A request with one output token has nothing to
decode and always runs whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from services.job_executor import ledger
from services.views import TEView
from shared.messages.cluster import JobShare, TEState
from shared.messages.tasks import TaskMode

PdMode = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True, slots=True)
class PdConfig:
    mode: PdMode = "auto"
    min_uncached_tokens: int = 2048
    min_uncached_ratio: float = 0.7
    max_prefill_queue_tokens: int = 32768


@dataclasses.dataclass(frozen=True, slots=True)
class PdDecision:
    prefill_te: str | None  # None: the decode instance prefills the prompt itself
    reason: str  # why, for logs, metrics and the scale events

    @property
    def disaggregated(self) -> bool:
        return self.prefill_te is not None


def prefill_instances(model: str, tes: Sequence[TEView]) -> list[TEView]:
    """The model's ready prefill instances that serve their KV."""
    return [
        te
        for te in tes
        if te.model == model
        and te.role == TaskMode.PREFILL
        and te.state == TEState.READY
        and te.kv_address
    ]


def decide(
    config: PdConfig,
    *,
    decode: TEView,
    prompt_tokens: int,
    cached_tokens: int,
    max_tokens: int,
    prefill_tes: Sequence[TEView],
    unreported: Mapping[str, JobShare],
) -> PdDecision:
    """``decode``: the instance routing chose; ``cached_tokens``: the prompt tokens it holds;
    ``prefill_tes``: the model's ready prefill instances (``prefill_instances``)."""
    if config.mode == "never":
        return PdDecision(None, "pd off")
    if max_tokens <= 1:
        return PdDecision(None, "nothing to decode")
    if not decode.kv_import:
        return PdDecision(None, "decode instance imports no KV")
    if not prefill_tes:
        return PdDecision(None, "no prefill instance")
    prefill = min(prefill_tes, key=lambda te: (ledger.prefill_tokens(te, unreported), te.te_id))
    if config.mode == "always":
        return PdDecision(prefill.te_id, "always")
    uncached = max(prompt_tokens - cached_tokens, 0)
    if uncached < config.min_uncached_tokens:
        return PdDecision(None, "short uncached prompt")
    if uncached < config.min_uncached_ratio * prompt_tokens:
        return PdDecision(None, "mostly cached prompt")
    if ledger.prefill_tokens(prefill, unreported) >= config.max_prefill_queue_tokens:
        return PdDecision(None, "prefill queue full")
    return PdDecision(prefill.te_id, "long uncached prompt")

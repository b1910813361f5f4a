"""Whether a request's prompt runs on a prefill instance (PD disaggregation), decided per
request after its decode instance is chosen. Pure: the services and the simulator call
``decide``.

Disaggregation does not raise throughput; it keeps long prefills from stalling the decode
iterations of other requests (TPOT), at the price of moving the prompt's KV. It pays for
long prompts the decode instance does not already hold, so the rule looks at the prompt
tokens *that instance* lacks (NVIDIA Dynamo's conditional disaggregation, llm-d's
``nonCachedTokens``): a prompt prefills locally when the uncached part is short
(``min_uncached_tokens``) or a small share of the prompt (``min_uncached_ratio``: mostly
cached), or when the prefill instances are backed up: the least busy one has more prompt
tokens queued than the decode instance itself (the decode instance would start the prompt
sooner on its own), or ``max_prefill_queue_tokens``. ``always`` disaggregates whenever a prefill
instance is ready; ``never`` never does. A request with one output token has nothing to
decode and always runs whole."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Literal

from services.job_executor import ledger
from services.job_executor.pd_heatmap import PdHeatmap
from services.job_executor.pd_heatmap import load as load_heatmaps
from services.job_executor.placement import kv_room
from services.views import TEView
from shared.messages.cluster import JobShare, TEState
from shared.messages.tasks import TaskMode
from shared.settings import JobExecutorSettings

PdMode = Literal["auto", "always", "never"]


@dataclasses.dataclass(frozen=True, slots=True)
class PdConfig:
    mode: PdMode = "auto"
    min_uncached_tokens: int = 2048
    min_uncached_ratio: float = 0.7
    max_prefill_queue_tokens: int = 32768
    # Measured heat maps by model (``pd_heatmap``): where one covers the model, it decides
    # instead of ``min_uncached_tokens``.
    heatmaps: Mapping[str, PdHeatmap] = dataclasses.field(default_factory=dict)


def pd_config(settings: JobExecutorSettings) -> PdConfig:
    """The rule's parameters from the job executor's settings (``MESHSERVE_PD*``): the
    service and ``meshserve-loadgen simulate`` build them here."""
    return PdConfig(
        mode=settings.pd,
        min_uncached_tokens=settings.pd_min_uncached_tokens,
        min_uncached_ratio=settings.pd_min_uncached_ratio,
        max_prefill_queue_tokens=settings.pd_max_prefill_queue_tokens,
        heatmaps=load_heatmaps(settings.pd_heatmap) if settings.pd_heatmap else {},
    )


@dataclasses.dataclass(frozen=True, slots=True)
class PdDecision:
    prefill_te: str | None  # None: the decode instance prefills the prompt itself
    reason: str  # why, for logs, metrics and the scale events
    # The rule would send it to a prefill instance were one ready and not backed up (the
    # size test, with a decode instance that imports KV): its uncached prompt tokens are
    # prefill work for the scaler.
    wanted: bool = False

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


def _stays_whole(config: PdConfig, decode: TEView, max_tokens: int) -> str | None:
    """Why the request runs on its decode instance whatever its prompt, or None."""
    if config.mode == "never":
        return "pd off"
    if max_tokens <= 1:
        return "nothing to decode"
    if not decode.kv_import:
        return "decode instance imports no KV"
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Demand:
    """What the heat map's cell of a request depends on besides its prompt: its predicted
    output tokens (``output_length.OutputPredictor``) and the model's recent requests/s per
    instance (``traffic.RateMeter``)."""

    output_tokens: int
    rate_per_instance: float


def _too_small(
    config: PdConfig, model: str, prompt_tokens: int, cached_tokens: int, demand: Demand | None
) -> str | None:
    """Why the prompt is not worth moving (``auto``: the uncached part is a small share of
    it, or short, or where the model has a heat map, in a cell where PD does not pay), or
    None."""
    if config.mode == "always":
        return None
    uncached = max(prompt_tokens - cached_tokens, 0)
    if uncached < config.min_uncached_ratio * prompt_tokens:
        return "mostly cached prompt"
    heatmap = config.heatmaps.get(model)
    if heatmap is not None and demand is not None:
        if heatmap.pays(uncached, demand.output_tokens, demand.rate_per_instance):
            return None
        return "heat map: colocated"
    if uncached < config.min_uncached_tokens:
        return "short uncached prompt"
    return None


def decide(
    config: PdConfig,
    *,
    decode: TEView,
    prompt_tokens: int,
    cached_tokens: int,
    max_tokens: int,
    prefill_tes: Sequence[TEView],
    unreported: Mapping[str, JobShare],
    demand: Demand | None = None,
) -> PdDecision:
    """``decode``: the instance routing chose; ``cached_tokens``: the prompt tokens it holds;
    ``prefill_tes``: the model's ready prefill instances (``prefill_instances``); ``demand``:
    what a heat map's cell needs besides the prompt (none: the thresholds decide)."""
    if reason := _stays_whole(config, decode, max_tokens):
        return PdDecision(None, reason)
    too_small = _too_small(config, decode.model or "", prompt_tokens, cached_tokens, demand)
    wanted = too_small is None
    if not prefill_tes:
        return PdDecision(None, "no prefill instance", wanted)
    if too_small:
        return PdDecision(None, too_small)
    # Where the prompt's KV fits: a prefill instance holds each prompt's KV until its decode
    # instance has pulled it, so one without room would make the prompt wait there.
    uncached = max(prompt_tokens - cached_tokens, 0)
    roomy = [
        te for te in prefill_tes if (room := kv_room(te, unreported)) is None or room >= uncached
    ]
    if not roomy:
        return PdDecision(None, "prefill KV full", wanted)
    prefill = min(roomy, key=lambda te: (ledger.prefill_tokens(te, unreported), te.te_id))
    if config.mode != "always":
        queued = ledger.prefill_tokens(prefill, unreported)
        if queued >= config.max_prefill_queue_tokens:
            return PdDecision(None, "prefill queue full", wanted)
        # The prompt would start later there than on its decode instance: its TTFT would pay
        # for the split (on a saturated fleet, most of all).
        if queued > ledger.prefill_tokens(decode, unreported):
            return PdDecision(None, "prefill queue longer", wanted)
    return PdDecision(
        prefill.te_id, "always" if config.mode == "always" else "long uncached prompt", wanted
    )

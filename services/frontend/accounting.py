"""What the frontend counts for the cluster's metrics (it serves them, at ``/metrics``): each
request as it ends (vLLM's families, ``request_metrics``; whether it was held for capacity,
how it was routed, whether it met the SLO, which also goes to the scaler's ``Outcomes``),
where its time to first token went, and each scale event the scaler announces."""

from __future__ import annotations

import time

from prometheus_client import Counter, Histogram

from services.frontend import request_metrics
from services.frontend.generation import Generation
from services.frontend.outcomes import Outcomes
from services.frontend.recent import Recent
from shared.messages.cluster import ClusterView
from shared.messages.scaling import ScaleEvent

SLO_MET = Counter(
    "meshserve_slo_requests", "Finished requests, by whether they met the SLO", ["model", "met"]
)
HELD = Counter(
    "meshserve_held_requests", "Requests held while their model scaled up or out", ["model"]
)
HELD_WAIT = Histogram(
    "meshserve_held_wait_seconds",
    "How long a held request waited for an instance",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
ROUTED = Counter(
    "meshserve_routing_decisions",
    "Requests placed, by the routing branch that chose the TE and whether the prompt index "
    "said it held a prefix of the prompt",
    ["model", "branch", "hit"],
)
ROUTED_TOKENS = Counter(
    "meshserve_routing_prompt_tokens",
    "Prompt tokens of placed requests: all of them (prompt), the leading ones the prompt index "
    "matched on the chosen TE (matched) and on the ready TE holding the most (best: what an "
    "oracle router would reuse), and those the chosen TE's prefix cache actually held (cached)",
    ["model", "kind"],
)


PD_REQUESTS = Counter(
    "meshserve_pd_requests",
    "Placed requests by whether their prompt ran on a prefill instance (disaggregated) and "
    "why (disaggregation.decide: always, long uncached prompt, short uncached prompt, mostly "
    "cached prompt, prefill queue full, prefill queue longer, prefill KV full, no prefill "
    "instance, continued from a lost JE's prefill, ...)",
    ["model", "disaggregated", "reason"],
)
KV_TRANSFER_BYTES = Counter(
    "meshserve_kv_transfer_bytes",
    "Prompt KV bytes moved from prefill to decode instances, by transport (shm, tcp)",
    ["model", "transport"],
)
KV_TRANSFER_SECONDS = Histogram(
    "meshserve_kv_transfer_seconds",
    "A disaggregated request's KV pull, from its decode task's start to the KV in hand (its "
    "prefill included: the transfer overlaps it)",
    ["model", "transport"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
PD_FALLBACKS = Counter(
    "meshserve_pd_fallbacks",
    "Disaggregated requests whose KV did not arrive, so that the decode instance prefilled "
    "them itself (MESHSERVE_PD_FALLBACK=recompute) or they failed (fail)",
    ["model"],
)


def account(
    outcomes: Outcomes,
    recent: Recent,
    model: str,
    gen: Generation,
    prompt_tokens: int,
    t0: float,
) -> None:
    """A request ended (however): its metrics, and its outcome for the scaler. ``t0``: when
    its job was first submitted (monotonic). Metrics name the model as the client did (a
    fine-tuned model by its own name); the outcome counts for the model whose TEs ran it."""
    n = len(gen.generated)
    request_metrics.observe(
        model_name=gen.base_model or model,
        adapter=gen.adapter,
        tenant=gen.tenant,
        prompt_tokens=prompt_tokens,
        output_tokens=n,
        finish_reason=gen.finish_reason,
        submitted=t0,
        accepted=gen.accepted_at,
        first_token=gen.first_token_at,
        last_token=gen.last_token_at,
        ended=time.monotonic(),
        token_gaps=gen.token_gaps,
    )
    ttft = None if gen.first_token_at is None else gen.first_token_at - t0
    tpot = None
    if n > 1 and gen.first_token_at is not None and gen.last_token_at is not None:
        tpot = (gen.last_token_at - gen.first_token_at) / (n - 1)
    if gen.held_s is not None:
        HELD.labels(model).inc()
        HELD_WAIT.labels(model).observe(gen.held_s)
    if (routed := gen.routed) is not None:
        hit = "yes" if routed.matched_tokens else "no"
        ROUTED.labels(model, routed.routing or "none", hit).inc()
        ROUTED_TOKENS.labels(model, "prompt").inc(prompt_tokens)
        ROUTED_TOKENS.labels(model, "matched").inc(routed.matched_tokens)
        ROUTED_TOKENS.labels(model, "best").inc(routed.best_matched_tokens)
        ROUTED_TOKENS.labels(model, "cached").inc(gen.cached_tokens)
    if routed is not None and routed.pd:
        disaggregated = "yes" if routed.prefill_te_id else "no"
        PD_REQUESTS.labels(model, disaggregated, routed.pd).inc()
    if (kv := gen.kv) is not None:
        if kv.fallback:
            PD_FALLBACKS.labels(model).inc()
        else:
            KV_TRANSFER_BYTES.labels(model, kv.transport).inc(kv.bytes)
            KV_TRANSFER_SECONDS.labels(model, kv.transport).observe(kv.seconds)
    met = outcomes.record(
        gen.base_model or model,  # the scaler sizes the base model's fleet (adapters share it)
        ok=gen.finish_reason is not None,
        prompt_tokens=prompt_tokens,
        output_tokens=n,
        ttft_s=ttft,
        tpot_s=tpot,
    )
    SLO_MET.labels(model, str(met).lower()).inc()
    recent.request(model, at=time.time(), ttft_s=ttft, met=met, held=gen.held_s is not None)


PHASE = Histogram(
    "meshserve_request_phase_seconds",
    "Where a request's time to first token goes: in the frontend before the job is submitted "
    "(parse, auth, validation, tokenization, limits: frontend_in), job submitted to placed "
    "(placement; of it, the job executor's own time: je), placed to first token at the "
    "frontend (first_token; of it, the TE's own time from the task accepted to the token "
    "sent: te), first token to its bytes handed to the client (frontend_out)",
    ["phase"],
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
)


def phases(arrived: float, submitted: float, gen: Generation) -> None:
    """``PHASE``: a request's first token, handed to the client now, by where it went."""
    if gen.accepted_at is None or gen.first_token_at is None or gen.held_s is not None:
        return  # held for capacity: a scale-up, not serving overhead
    now = time.monotonic()
    PHASE.labels("frontend_in").observe(submitted - arrived)
    PHASE.labels("placement").observe(gen.accepted_at - submitted)
    if gen.routed is not None:
        PHASE.labels("je").observe(gen.routed.je_s)
    PHASE.labels("first_token").observe(gen.first_token_at - gen.accepted_at)
    PHASE.labels("te").observe(gen.te_s)
    PHASE.labels("frontend_out").observe(now - gen.first_token_at)


KV_LEASE_ENDS = Counter(
    "meshserve_kv_lease_ends",
    "Prompt KV leases prefill instances held for decode instances that ended, by how: "
    "released (pulled), rejected, disconnected (the decode instance dropped the connection), "
    "expired (it went silent), cancelled or failed (the prefill task), closed (the prefill "
    "instance stopping)",
    ["model", "reason"],
)


class LeaseEnds:
    """Counts the growth of each TE's ``kv_lease_ends`` from one cluster view to the next. A
    TE process is known by its id and start time: a restarted one counts from zero, one that
    was missing from some views from where it was."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, float], dict[str, int]] = {}

    def on_view(self, view: ClusterView) -> None:
        for te in view.tes:
            if not te.kv_lease_ends:
                continue
            before = self._seen.get((te.te_id, te.started_at), {})
            for reason, n in te.kv_lease_ends.items():
                if (grown := n - before.get(reason, 0)) > 0:
                    KV_LEASE_ENDS.labels(te.model or te.failed_model or "", reason).inc(grown)
            self._seen[(te.te_id, te.started_at)] = dict(te.kv_lease_ends)


SCALE_EVENTS = Counter(
    "meshserve_scale_events", "Scale-ups and scale-downs done", ["kind", "model", "ok"]
)
SCALE_STEP = Histogram(
    "meshserve_scale_step_seconds",
    "Time of each step of a scale event (DeepServe's five for a scale-up)",
    ["kind", "step"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)


async def on_scale_event(msg: ScaleEvent) -> None:
    """A scale event the scaler announced (the frontend serves the cluster's metrics)."""
    SCALE_EVENTS.labels(msg.kind, msg.model, str(msg.ok).lower()).inc()
    for step, seconds in msg.steps.items():
        SCALE_STEP.labels(msg.kind, step).observe(seconds)

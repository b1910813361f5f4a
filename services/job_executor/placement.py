"""Which TE gets a task. Pure: observed state in, decision out.

Among ready TEs of the job's model, the routing policy (``routing.route``) chooses from each
one's load and the prompt tokens it already holds. Load is outstanding work in tokens: the
prompt tokens queued on the TE for prefill (each placement's prompt after the prefix the TE
holds), plus DECODE_COST_TOKENS for each sequence it decodes, as its last report counted
them corrected by what this JE placed there and heard of since (``ledger``). A count of requests would treat a
4,000-token prompt like a 40-token one and queue short prompts behind long prefills. PD
pairs (DeepServe's first branch) come with disaggregation.

A request a KV preemption handed back goes first to the TE the preemption validated it on
(``kv_sizing.preemption`` played it there with shadow validation, as the simulator places
it): the routing branch ``validated``. Where that TE is gone, busy loading something else or
refused it, routing chooses as for any request.

While another instance of the model loads, a ready TE takes a request that can still meet
its TTFT only if it would prefill its queue and the request's prompt in the time left
(late binding): a scale-out's first instance up does not take every request held for it,
to serve them one after another while the instances behind it come up empty. What none can
take in time waits, held, for the first instance that can (one loads, or a queue drains).
A request already late goes where routing says (it keeps no instance coming up from one
still in time), and once nothing loads, routing chooses among all as before."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

from services.job_executor import ledger
from services.job_executor.routing import DEFAULT_ROUTING, Candidate, RoutingConfig, route
from services.views import TEView
from shared.messages.cluster import JobShare, TEState


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    te_id: str | None  # None: nothing can take the job now
    scale_up: bool = False  # no instance is ready or coming: the scaler must add one
    branch: str = ""  # the routing policy's reason


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """What routing knows of the request beyond its model."""

    prompt_tokens: int = 0
    cached_tokens: Mapping[str, int] = dataclasses.field(default_factory=dict)  # per TE
    spread: int = 0  # a number of its own, for ties (round-robin: the JE's counter)
    adapter: str = ""  # a fine-tuned model's LoRA adapter ("": the base model)
    # The TE a KV preemption validated the request on (``ChatJob.prefer_te_id``): chosen
    # over what routing would say while it is ready and not excluded.
    prefer: str = ""
    # Seconds left before its TTFT limit (``SLO.ttft_limit_s`` from its arrival): while an
    # instance of its model loads, no ready TE that would start it later takes it (inf: no
    # limit; 0 or less: late already, any).
    ttft_left_s: float = math.inf


NO_REQUEST = Request()
VALIDATED = "validated"  # the branch of a preempted request placed where it validated


# What one decoding sequence weighs against queued prompt tokens: it takes a batch slot
# and a token of every iteration until it ends.
DECODE_COST_TOKENS = 32
# What loading a request's LoRA adapter weighs, for a TE that does not hold it yet: tens of
# milliseconds, about a short prompt's prefill.
ADAPTER_LOAD_TOKENS = 256


def te_load(te: TEView, unreported: Mapping[str, JobShare]) -> int:
    """Outstanding work in tokens. ``unreported``: per TE, what its report does not show
    (``ledger.PlacementLedger.unreported``)."""
    return ledger.prefill_tokens(te, unreported) + DECODE_COST_TOKENS * ledger.decoding(
        te, unreported
    )


def kv_room(te: TEView, unreported: Mapping[str, JobShare]) -> int | None:
    """KV tokens the TE can still give new prompts: what its engine reported free, less what
    the tasks queued there (reported, and placed since) will take: the prompt tokens they
    prefill, and those whose KV decode tasks take in from prefill TEs (PD). None where its
    engine does not say."""
    if te.kv_free_tokens is None:
        return None
    return (
        te.kv_free_tokens
        - ledger.prefill_tokens(te, unreported)
        - ledger.import_tokens(te, unreported)
    )


def prefill_wait_s(te: TEView, unreported: Mapping[str, JobShare], request: Request) -> float:
    """Seconds the TE needs to prefill what is queued on it and the request's prompt, less
    the prefix it holds (0 where its capacity is not known)."""
    if te.capacity is None:
        return 0.0
    tokens = ledger.prefill_tokens(te, unreported) + max(
        request.prompt_tokens - request.cached_tokens.get(te.te_id, 0), 0
    )
    return tokens / te.capacity.prefill_tokens_per_s(request.prompt_tokens)


def pick_te(
    model: str,
    tes: Sequence[TEView],
    unreported: Mapping[str, JobShare],
    exclude: Collection[str] = (),
    request: Request = NO_REQUEST,
    config: RoutingConfig = DEFAULT_ROUTING,
) -> Placement:
    ready = [
        te
        for te in tes
        if te.model == model
        and te.state == TEState.READY
        and te.te_id not in exclude
        and (te.lora or not request.adapter)
    ]
    loading = [te for te in tes if te.model == model and te.state == TEState.LOADING]
    if not ready:
        return Placement(te_id=None, scale_up=not loading)
    if request.prefer and any(te.te_id == request.prefer for te in ready):
        return Placement(te_id=request.prefer, branch=VALIDATED)
    if 0 < request.ttft_left_s < math.inf and any(te.lora or not request.adapter for te in loading):
        ready = [
            te for te in ready if prefill_wait_s(te, unreported, request) <= request.ttft_left_s
        ]
        if not ready:  # held for the instance coming up, or a queue that drains
            return Placement(te_id=None)
    candidates = [
        Candidate(
            te.te_id,
            te_load(te, unreported)
            + (ADAPTER_LOAD_TOKENS if request.adapter not in te.adapters | {""} else 0),
            request.cached_tokens.get(te.te_id, 0),
            sequences=ledger.sequences(te, unreported),
            slots=te.capacity.max_num_seqs if te.capacity is not None else 0,
            kv_room=kv_room(te, unreported),
        )
        for te in ready
    ]
    chosen = route(candidates, request.prompt_tokens, config, request.spread)
    return Placement(te_id=chosen.te_id, branch=chosen.branch)

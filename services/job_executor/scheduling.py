"""Which TE gets a task. Pure: observed state in, decision out.

For now: among ready TEs of the job's model, the least loaded, where load is outstanding
work in tokens: the prompt tokens the TE last reported queued for prefill, plus those this
JE placed on it since that report, plus DECODE_COST_TOKENS for each sequence it decodes. A
count of requests would treat a 4,000-token prompt like a 40-token one and queue short
prompts behind long prefills. Later policies (prefix locality, PD pairs, DeepServe's
Algorithm 1) replace the body and keep the signature."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from services.views import TEView
from shared.messages.cluster import TEState


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    te_id: str | None  # None: nothing can take the job now
    scale_up: bool = False  # no instance is ready or coming: the scaler must add one


# What one decoding sequence weighs against queued prompt tokens: it takes a batch slot
# and a token of every iteration until it ends.
DECODE_COST_TOKENS = 32


def te_load(te: TEView, placed_since_report: Mapping[str, int]) -> int:
    """Outstanding work in tokens. ``placed_since_report``: prompt tokens placed per TE."""
    return (
        te.queued_prompt_tokens
        + placed_since_report.get(te.te_id, 0)
        + DECODE_COST_TOKENS * te.running
    )


def pick_te(
    model: str,
    tes: Sequence[TEView],
    placed_since_report: Mapping[str, int],
    exclude: Collection[str] = (),
) -> Decision:
    ready = [
        te
        for te in tes
        if te.model == model and te.state == TEState.READY and te.te_id not in exclude
    ]
    if not ready:
        loading = any(te.model == model and te.state == TEState.LOADING for te in tes)
        return Decision(te_id=None, scale_up=not loading)
    best = min(ready, key=lambda te: (te_load(te, placed_since_report), te.te_id))
    return Decision(te_id=best.te_id)

"""Which TE gets a task. Pure: observed state in, decision out.

For now: among ready TEs of the job's model, the least loaded, where load is what the TE
last reported (running + waiting) plus the tasks this JE placed on it since that report.
Later policies (prefix locality, PD pairs, DeepServe's Algorithm 1) replace the body and
keep the signature."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence

from shared.messages.cluster import TEHeartbeat, TEState


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    te_id: str | None  # None: nothing can take the job now
    scale_up: bool = False  # ask the scaler for an instance of the model


def te_load(te: TEHeartbeat, placed_since_report: Mapping[str, int]) -> int:
    return te.running + te.waiting + placed_since_report.get(te.te_id, 0)


def pick_te(
    model: str,
    tes: Sequence[TEHeartbeat],
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

"""One tick of the scaler, pure: what settled since the last tick, the scaling decision, and
the pre-loads on the TEs it left alone. The scaler service runs it every ``TICK_S`` on the
cluster view (``service.py``, which then sends the commands and measures the events);
``meshserve-loadgen simulate`` runs it on its simulated TEs (``loadgen/simulator.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from services.scaler.policy import ScaleDecision, decide
from services.scaler.preload import Preload, preloads
from services.scaler.state import ScalerConfig, ScalerState, Settled, observe_view
from services.views import TEView


@dataclasses.dataclass(frozen=True, slots=True)
class Tick:
    state: ScalerState  # to keep for the next tick
    settled: list[Settled]  # loads and unloads the view shows done, failed or lost
    decision: ScaleDecision
    preloads: list[Preload]


def tick(
    state: ScalerState,
    tes: Sequence[TEView],
    *,
    models: Sequence[str],
    now: float,
    cfg: ScalerConfig,
    tried: Mapping[tuple[str, str], float],
) -> Tick:
    """``observe_view``, then ``decide`` on what it leaves, then ``preloads`` on the TEs the
    decision did not take (``tried``: (model, pool) -> when a pre-load was last sent)."""
    state, settled = observe_view(state, tes, now=now, cfg=cfg)
    decision = decide(state, tes, models=models, now=now, cfg=cfg)
    taken = {a.te_id for a in decision.actions}
    spare = [te for te in tes if te.te_id not in taken]
    chosen = preloads(decision.state, spare, models=models, now=now, cfg=cfg, tried=tried)
    return Tick(state=decision.state, settled=settled, decision=decision, preloads=chosen)

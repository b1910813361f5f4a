"""Admission control: refuse a job now, with 503 and Retry-After, when the cluster cannot
serve it in time, instead of letting it queue until the client's deadline. Pure.

A TE accepts every task it is given and queues those its batch has no room for, so without
this a burst beyond the cluster's capacity makes every request slower until they time out
together. A job is shed when both hold:

- every ready instance of its model is saturated: the sequences on it beyond one batch
  (``InstanceCapacity.max_num_seqs``) fill ``max_queued_per_slot`` batches, so a new one
  waits for that many batches to finish. The sequences are the TE's last report corrected
  by what this JE placed there and heard of since, each placement by its id
  (``ledger``): exact at any request rate, so a sequential client is never refused;
- no capacity is coming: no instance of the model is loading, and no TE is idle (or only
  pre-loading weights, or draining: it turns idle when its last streams end) for the scaler
  to load it on.

An instance whose capacity is unknown never counts as saturated, and a model with no ready
instance is the scale-from-zero path (``holding.next_step`` holds the job), not this one.
Retry-After is the time the least-queued instance needs to run its queue down to a free
slot, one full batch of ``mean_output_tokens`` per ``max_num_seqs`` queued sequences.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping

from services.job_executor import ledger
from services.views import TEView
from shared.messages.cluster import JobShare, TEState

# Output tokens jobs ask for, a moving mean over about the last 64 jobs: how long a queued
# batch takes to clear (its start before any job arrived).
INITIAL_MEAN_OUTPUT_TOKENS = 256.0


def mean_output_tokens(mean: float, max_tokens: int) -> float:
    """The moving mean after a job asking for ``max_tokens``."""
    return mean + (max_tokens - mean) / 64


@dataclasses.dataclass(frozen=True, slots=True)
class Shed:
    retry_after_s: float
    queued: int  # sequences queued on the least-queued instance
    instances: int  # ready instances, all saturated


def capacity_coming(model: str, tes: Collection[TEView]) -> bool:
    """A TE the scaler can load the model on (idle, only filling its host's weight cache, or
    draining: a scale-in just before a burst leaves TEs that turn idle as their last streams
    end), or an instance of the model loading."""
    return any(
        te.state in (TEState.IDLE, TEState.PRELOADING, TEState.DRAINING) for te in tes
    ) or any(te.model == model and te.state == TEState.LOADING for te in tes)


def device_busy(model: str, tes: Collection[TEView], busy: Collection[str]) -> bool:
    """Every ready instance of the model refused the job after its device's shadow
    validation (``busy``: those TEs) and no capacity is coming: the job cannot be served in
    time, and is refused now rather than held until it is late."""
    ready = [te.te_id for te in tes if te.model == model and te.state == TEState.READY]
    return bool(ready) and set(ready) <= set(busy) and not capacity_coming(model, tes)


def shed(
    model: str,
    tes: Collection[TEView],
    unreported: Mapping[str, JobShare],
    *,
    max_queued_per_slot: int,
    mean_output_tokens: float,
) -> Shed | None:
    """``Shed`` if the job must be refused now, None if it may be placed or held."""
    if max_queued_per_slot <= 0:
        return None
    ready = [te for te in tes if te.model == model and te.state == TEState.READY]
    if not ready or capacity_coming(model, tes):
        return None
    waits = []
    for te in ready:
        cap = te.capacity
        if cap is None:
            return None
        queued = ledger.sequences(te, unreported) - cap.max_num_seqs  # beyond one batch
        if queued < max_queued_per_slot * cap.max_num_seqs:
            return None
        batches = queued / cap.max_num_seqs
        waits.append((batches * mean_output_tokens * cap.step_s(), queued))
    wait, queued = min(waits)
    return Shed(retry_after_s=max(1.0, wait), queued=queued, instances=len(ready))

"""A shared device as its node pool's arbiter sees it, told to the pools of other devices:
where a preempted neighbour's requests could go (``kv_sizing.preemption`` validates them
there with shadow validation, ``services/job_executor/shadow.py``)."""

from __future__ import annotations

import msgspec

from shared.messages.base import Message
from shared.messages.tasks import TaskMode
from shared.perf_model import PerfModel


class DeviceRequest(msgspec.Struct, frozen=True, array_like=True):
    """A request an instance holds (``shared.headroom.RequestView``). Times are seconds on
    the sender's monotonic clock."""

    arrival: float
    prompt_tokens: int
    expected_output: int
    ttft_slo: float
    tpot_slo: float
    computed_tokens: int = 0
    output_tokens: int = 0
    id: str = ""


class DeviceInstance(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One instance on the device: what its TE serves, as shadow validation plays it."""

    te_id: str
    model: str
    role: TaskMode = TaskMode.COLOCATED
    perf: PerfModel
    max_num_seqs: int
    max_prefill_tokens: int
    stretch: float = 1.0  # its real iterations over its profile's predictions
    late_yield_s: float = 0.0  # its engine's late yield (0: prompts by deadline alone)
    requests: list[DeviceRequest] = msgspec.field(default_factory=list)


class DeviceSnapshot(Message):
    """The instances of one device and the requests they hold, sent by its node pool twice a
    second while KV preemption is on (``MESHSERVE_KV_PREEMPTION``). ``at``: the sender's
    monotonic clock when it was taken (a receiver moves the requests' times onto its own)."""

    pool_id: str
    device: str
    at: float
    instances: list[DeviceInstance] = msgspec.field(default_factory=list)

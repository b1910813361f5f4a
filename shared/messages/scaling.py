"""Scaling demands and the commands that load, unload and drain task executors."""

from __future__ import annotations

import msgspec

from shared.messages.base import Message
from shared.messages.tasks import TaskMode


class ModelTraffic(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One model's jobs at one JE: arrivals since its last report, and what it holds now."""

    model: str
    arrivals: int = 0  # jobs received since the last report (resubmissions too)
    prompt_tokens: int = 0  # their prompt tokens
    max_output_tokens: int = 0  # their output caps (max_tokens)
    held: int = 0  # jobs held now: no instance could take them
    held_prompt_tokens: int = 0
    misses: int = 0  # jobs failed since the last report: the placement deadline passed
    # Of the jobs placed since the last report, those whose prompt the PD rule sends to a
    # prefill instance (whether or not one is ready), and the prompt tokens they would
    # compute there (the part their decode instance lacks): the scaler's prefill load.
    pd_arrivals: int = 0
    pd_prompt_tokens: int = 0
    # Of those, the prompt tokens that did go to a prefill instance (its decode task placed
    # against it): what the prefill instances took off the others.
    pd_placed_tokens: int = 0


class TrafficReport(Message):
    """A JE's traffic, sent every report interval while it has any, and at once when a job
    is held for a model with no instance able to take it (``urgent``)."""

    je_id: str
    models: list[ModelTraffic] = msgspec.field(default_factory=list)
    urgent: bool = False


class ModelOutcomes(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    finished: int = 0  # requests finished since the last report (failed ones too)
    slo_met: int = 0  # of which met the SLO (settings: scaler.slo_*)
    output_tokens: int = 0


class OutcomeReport(Message):
    """A frontend's finished requests since its last report: what clients saw."""

    frontend_id: str
    models: list[ModelOutcomes] = msgspec.field(default_factory=list)


class InstanceCapacity(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one instance of a model on one engine and device costs per token, measured once
    (by the TE, on the first load of the model there; or from a ``meshserve-loadgen
    profile``): the scaler turns a model's token rates into instances with it. Prefilling a
    prompt of n tokens costs ``n * (prefill_s + prefill_attention_s * n)``; decoding one
    token at a context of c tokens, in a full batch, ``decode_s + decode_context_s * c``."""

    prefill_s: float  # per prompt token
    prefill_attention_s: float  # per prompt token, per token of its prompt
    decode_s: float  # per output token, batch of max_num_seqs, short context
    decode_context_s: float  # per output token, per context token it attends over
    max_num_seqs: int
    engine: str = ""
    device: str = ""
    measured_at: float = 0.0
    decode_step_s: float = 0.0  # one step of that full batch (0: not measured, older stores)

    def prefill_tokens_per_s(self, prompt_tokens: int) -> float:
        return 1.0 / (self.prefill_s + self.prefill_attention_s * prompt_tokens)

    def decode_tokens_per_s(self, context_tokens: int) -> float:
        return 1.0 / (self.decode_s + self.decode_context_s * context_tokens)

    def step_s(self) -> float:
        """A decode step of the full batch at a short context."""
        return self.decode_step_s or self.decode_s * self.max_num_seqs


class Multicast(msgspec.Struct, frozen=True):
    """This load's part in a multicast of the model's weights (lambda-Scale's binomial
    pipeline): node ``node`` of ``nodes`` (relay addresses; node 0 the weight server of a
    pool holding the model, ``source`` its request address), blocks of ``block_bytes``."""

    node: int
    nodes: list[str]
    source: str
    block_bytes: int


class LoadModel(Message):
    model: str
    path: str
    # The capacity measured on an earlier load; None: measure it before turning ready.
    capacity: InstanceCapacity | None = None
    # host:port of another pool's weight server holding the model (a fork over TCP), for a
    # pool whose host cache lacks it; None: this host's cache, else the checkpoint.
    weights_from: str | None = None
    # several loads of the model at once: the weights arrive by multicast (then, on failure,
    # by a fork from weights_from)
    multicast: Multicast | None = None
    # What the instance serves: colocated (whole requests; also decode tasks, and prompts
    # whose KV it imports), prefill (prefill tasks only) or decode (as colocated, counted by
    # the scaler as the decode side of a disaggregated model). The engine must support it.
    role: TaskMode = TaskMode.COLOCATED
    # The scaler leader's epoch it was decided under (shared/leader.py): a TE refuses a
    # command whose epoch a newer leader has passed (a deposed scaler's); 0: no leader.
    fence: int = 0


class PreloadModel(Message):
    """Put the model's weights into this TE's host weight cache, in the engine's form, and
    serve nothing: a later load on the host maps them (the scaler's pre-loading). The TE
    is ``preloading`` meanwhile, then idle again."""

    model: str
    path: str
    weights_from: str | None = None  # as LoadModel's
    fence: int = 0  # as LoadModel's


class UnloadModel(Message):
    """Take no new work, finish the running requests (those still running after
    ``drain_s`` are handed back to be resubmitted elsewhere), then unload."""

    reason: str = ""
    drain_s: float | None = None  # None: the TE's shutdown grace
    fence: int = 0  # as LoadModel's


class ScaleEvent(Message):
    """One scale-up or scale-down, done, with its steps (DeepServe's five for an up:
    scaler_pre, te_pre_load, te_load, te_post_load, scaler_post; drain and unload for a
    down), in seconds."""

    kind: str  # "up" | "down"
    model: str
    te_id: str
    pool_id: str
    reason: str = ""
    ok: bool = True
    steps: dict[str, float] = msgspec.field(default_factory=dict)
    total_s: float = 0.0


class Drain(Message):
    """Finish running requests, accept no new ones, then exit."""


class ControlAck(Message):
    te_id: str
    ok: bool
    error: str | None = None

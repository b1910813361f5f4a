"""A task's spans, recorded when it ends (its times are known only then): ``task {model}``
from the TE accepting it to its end, with ``queue`` (accepted until the engine took it),
``prefill`` (until its first token) and ``decode`` (until its last) inside, and for a
disaggregated decode task ``kv_transfer`` (its pull of the prompt's KV from the prefill TE:
transport, bytes, tokens it held already; an error status with the reason when it fell
back); the parent is the job executor's placement span the task's message carried
(``shared/tracing.py``)."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from shared import tracing
from shared.messages.tasks import KvTransferNote


def record(
    parent: Any,
    *,
    model: str,
    request_id: str,
    accepted: float,
    started: float,
    first_token: float,
    ended: float,
    prompt_tokens: int,
    output_tokens: int,
    finish_reason: str | None,
    kv: KvTransferNote | None = None,
    kv_window: tuple[float, float] | None = None,
) -> None:
    """``parent``: the OpenTelemetry context captured when the task arrived; times are
    ``time.monotonic()`` readings (0: never reached); ``kv``, ``kv_window``: a decode task's
    KV pull and when it began and ended."""
    now_ns, now = time.time_ns(), time.monotonic()

    def ns(t: float) -> int:
        return now_ns - int((now - t) * 1e9)

    tracer = tracing.tracer()
    task = tracer.start_span(
        f"task {model}",
        context=parent,
        kind=trace.SpanKind.SERVER,
        start_time=ns(accepted),
        attributes={
            tracing.REQUEST_MODEL: model,
            tracing.REQUEST_ID: request_id,
            tracing.INPUT_TOKENS: prompt_tokens,
            tracing.OUTPUT_TOKENS: output_tokens,
            tracing.FINISH_REASONS: [finish_reason or "abort"],
        },
    )
    inside = trace.set_span_in_context(task)
    marks = [("queue", accepted, started), ("prefill", started, first_token)]
    marks.append(("decode", first_token, ended))
    for name, start, end in marks:
        if start and end:
            tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(end))
    if kv is not None and kv_window is not None:
        attributes: dict[str, str | int] = {
            tracing.KV_PREFILL_TE: kv.prefill_te,
            tracing.KV_BYTES: kv.bytes,
            tracing.KV_HELD_TOKENS: kv.held_tokens,
        }
        if kv.transport:
            attributes[tracing.KV_TRANSPORT] = kv.transport
        if kv.fallback:
            attributes[tracing.KV_FALLBACK] = kv.fallback
        span = tracer.start_span(
            "kv_transfer", context=inside, start_time=ns(kv_window[0]), attributes=attributes
        )
        if kv.fallback:
            span.set_status(trace.Status(trace.StatusCode.ERROR, kv.fallback))
        span.end(end_time=ns(kv_window[1]))
    task.end(end_time=ns(ended))

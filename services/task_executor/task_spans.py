"""A task's spans, recorded when it ends (its times are known only then): ``task {model}``
from the TE accepting it to its end, with ``queue`` (accepted until the engine took it),
``prefill`` (until its first token) and ``decode`` (until its last) inside; the parent is the
job executor's placement span the task's message carried (``shared/tracing.py``)."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry import trace

from shared import tracing


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
) -> None:
    """``parent``: the OpenTelemetry context captured when the task arrived; times are
    ``time.monotonic()`` readings (0: never reached)."""
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
    task.end(end_time=ns(ended))

"""Traces: a span per hop of a request (frontend → job executor → TE, and the TE's queue,
prefill and decode), named and attributed after OpenTelemetry's GenAI conventions, the W3C
trace context carried in NATS headers (``traceparent``) by the bus.

With ``MESHSERVE_OTLP_ENDPOINT`` set, each service process exports its spans over OTLP/HTTP
in batches (``setup``). Unset, nothing is installed: OpenTelemetry's API answers with
non-recording spans, no context is injected into a message (``inject`` looks at the span
first) and nothing is exported. Log lines carry the current ``trace_id`` and ``span_id``
beside the request id (``shared/logging.py``)."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject

TRACER = "meshserve"
TRACEPARENT = "traceparent"
# OpenTelemetry's GenAI semantic conventions (gen_ai.*).
OPERATION = "gen_ai.operation.name"
REQUEST_MODEL = "gen_ai.request.model"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_TOKEN = "gen_ai.server.time_to_first_token"
REQUEST_ID = "meshserve.request_id"
# A disaggregated request's KV transfer (the decode TE's ``kv_transfer`` span).
KV_PREFILL_TE = "meshserve.kv.prefill_te"
KV_TRANSPORT = "meshserve.kv.transport"
KV_BYTES = "meshserve.kv.bytes"
KV_HELD_TOKENS = "meshserve.kv.held_tokens"
KV_FALLBACK = "meshserve.kv.fallback"


def setup(endpoint: str, service: str) -> bool:
    """Export this process's spans to ``endpoint`` (OTLP over HTTP, e.g.
    ``http://collector:4318/v1/traces``) as ``service``; nothing when ``endpoint`` is
    empty. Whether it is on."""
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"meshserve-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return True


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def inject(headers: MutableMapping[str, str]) -> None:
    """The current span's context into outgoing headers, if a span is recording (else
    nothing: no cost where tracing is off)."""
    if trace.get_current_span().is_recording():
        _inject(headers)


def attach(headers: Mapping[str, str] | None) -> object | None:
    """The sender's context made current (a token for ``detach``), or None when the
    message carried none."""
    if not headers or TRACEPARENT not in headers:
        return None
    return otel_context.attach(_extract(headers))


def detach(token: object | None) -> None:
    if token is not None:
        otel_context.detach(token)  # type: ignore[arg-type]


def current() -> otel_context.Context | None:
    """The current context where it holds a valid span (a task's spans' parent), else
    None."""
    if not trace.get_current_span().get_span_context().is_valid:
        return None
    return otel_context.get_current()


def ids() -> dict[str, str]:
    """The current span's trace and span ids (hex), for log lines; empty outside one."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}

"""One request's spans form one trace across three services (in-memory exporter): the
frontend's ``chat demo`` (GenAI attributes), the job executor's ``place demo`` inside it,
the TE's ``task demo`` inside that with its ``queue``, ``prefill`` and ``decode``; the
context crosses the bus in NATS headers. A disaggregated request adds the prefill TE's task
and the decode TE's ``kv_transfer``. Log lines inside a span carry its ids."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.task_executor.worker import TaskExecutor
from shared import tracing
from shared.logging import _trace_ids
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from shared.messages.tasks import TaskMode
from tests.integration.services import BusClient, control_plane, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis]


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """This process's spans, in memory (the provider is process-wide: it stays; the
    exporter stops keeping spans after the module)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    yield exporter
    exporter.shutdown()


async def test_a_requests_spans_form_one_trace(
    spans: InMemorySpanExporter,
    cluster: str,
    nats_url: str,
    redis_url: str,
    tmp_path: Path,
    demo_model_dir: Path,
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(cluster, nats_url, redis_url, tmp_path)
    async with control_plane(settings, nats_url, redis_url) as run:
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-t", pool_id="p")
        )
        await client.until(lambda v: len(v.tes) == 1, 30)
        ack = await client.tes.control("te-t", LoadModel(model="demo", path=str(tmp_path / "demo")))
        assert ack.ok, ack
        await client.until(lambda v: v.tes[0].state == TEState.READY, 60)
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{settings.frontend.http_port}/v1", api_key="none"
        )
        spans.clear()
        r = await api.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
        )
        assert r.usage is not None

        def one(name: str):  # type: ignore[no-untyped-def]
            found = [s for s in spans.get_finished_spans() if s.name == name]
            assert len(found) == 1, [s.name for s in spans.get_finished_spans()]
            return found[0]

        chat, place, task = one("chat demo"), one("place demo"), one("task demo")
        trace_id = chat.context.trace_id
        assert place.context.trace_id == task.context.trace_id == trace_id
        assert place.parent.span_id == chat.context.span_id
        assert task.parent.span_id == place.context.span_id
        for phase in ("queue", "prefill", "decode"):
            s = one(phase)
            assert s.context.trace_id == trace_id and s.parent.span_id == task.context.span_id
            assert task.start_time <= s.start_time <= s.end_time <= task.end_time
        assert chat.kind == trace.SpanKind.SERVER
        attrs = chat.attributes or {}
        assert attrs[tracing.OPERATION] == "chat" and attrs[tracing.REQUEST_MODEL] == "demo"
        assert attrs[tracing.REQUEST_ID] == r.id
        assert attrs[tracing.OUTPUT_TOKENS] == r.usage.completion_tokens
        assert attrs[tracing.INPUT_TOKENS] == r.usage.prompt_tokens
        assert tuple(attrs[tracing.FINISH_REASONS]) == (r.choices[0].finish_reason,)
        assert 0 < attrs[tracing.TIME_TO_FIRST_TOKEN] < chat.end_time - chat.start_time
        assert (task.attributes or {})[tracing.OUTPUT_TOKENS] == r.usage.completion_tokens


async def test_a_disaggregated_requests_kv_transfer_is_a_span_of_its_decode_task(
    spans: InMemorySpanExporter,
    cluster: str,
    nats_url: str,
    redis_url: str,
    tmp_path: Path,
    demo_model_dir: Path,
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(cluster, nats_url, redis_url, tmp_path, pd="always")
    roles = {"te-p": TaskMode.PREFILL, "te-d": TaskMode.DECODE}
    async with control_plane(settings, nats_url, redis_url) as run:
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        for te_id in roles:
            await run.start(
                lambda bus, te_id=te_id: TaskExecutor(
                    settings=settings, bus=bus, te_id=te_id, pool_id="p"
                )
            )
        await client.until(lambda v: len(v.tes) == 2, 30)
        path = str(tmp_path / "demo")
        for te_id, role in roles.items():
            ack = await client.tes.control(te_id, LoadModel(model="demo", path=path, role=role))
            assert ack.ok, ack
        await client.until(lambda v: all(t.state == TEState.READY for t in v.tes), 60)
        api = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{settings.frontend.http_port}/v1", api_key="none"
        )
        spans.clear()
        r = await api.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi there"}], max_tokens=5
        )
        assert r.usage is not None
    finished = spans.get_finished_spans()
    (chat,) = [s for s in finished if s.name == "chat demo"]
    tasks = [s for s in finished if s.name == "task demo"]
    assert len(tasks) == 2, [s.name for s in finished]  # the prefill's and the decode's
    (kv,) = [s for s in finished if s.name == "kv_transfer"]
    (decode,) = [t for t in tasks if t.context.span_id == kv.parent.span_id]
    assert {s.context.trace_id for s in (chat, kv, *tasks)} == {chat.context.trace_id}
    assert decode.start_time <= kv.start_time <= kv.end_time <= decode.end_time
    attrs = kv.attributes or {}
    assert attrs[tracing.KV_PREFILL_TE] == "te-p"
    assert attrs[tracing.KV_TRANSPORT] == "shm"  # one host
    assert attrs[tracing.KV_BYTES] > 0 and tracing.KV_FALLBACK not in attrs
    assert kv.status.status_code != trace.StatusCode.ERROR


def test_log_lines_inside_a_span_carry_its_ids(spans: InMemorySpanExporter) -> None:
    assert _trace_ids(None, "info", {"event": "x"}) == {"event": "x"}
    with tracing.tracer().start_as_current_span("outer") as span:
        ctx = span.get_span_context()
        line = _trace_ids(None, "info", {"event": "x"})
    assert line["trace_id"] == format(ctx.trace_id, "032x")
    assert line["span_id"] == format(ctx.span_id, "016x")

"""The frontend: the OpenAI-compatible HTTP API (aiohttp). It validates, tokenizes with
the model's own chat template, submits the job to a job executor and streams the TE's
tokens back to the client.

``Frontend`` coordinates the parts: the HTTP layer around every handler (``middleware``),
a request's checks (``validation``, ``rate_limits``), its generation, which survives the
loss of a JE or a TE (``generation``), its answer, whole or streamed (``answer``, with
``streaming``), and what it counts for the metrics this frontend serves (``accounting``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import structlog
from aiohttp import web
from opentelemetry.trace import SpanKind

from services.frontend import responses as R
from services.frontend.accounting import LeaseEnds, on_scale_event
from services.frontend.adapters import AdapterCatalog, is_fine_tuned
from services.frontend.admin import AdminAPI
from services.frontend.answer import Answerer
from services.frontend.auth import Authenticator, Principal, principal_of
from services.frontend.catalog import ModelCatalog
from services.frontend.files import FilesAPI
from services.frontend.fine_tuning import FineTuningAPI
from services.frontend.generation import Generation, StreamRouter
from services.frontend.liveness import Liveness
from services.frontend.middleware import MAX_BODY, auth_middleware, errors_middleware
from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest
from services.frontend.openapi import document as openapi_document
from services.frontend.outcomes import Outcomes
from services.frontend.rate_limits import Lease, Limiter, check_sizes
from services.frontend.recent import Recent
from services.frontend.status import model_state
from services.frontend.status import status as cluster_status
from services.frontend.streaming import StallGuard, raise_open_files_limit
from services.frontend.validation import (
    check_text_size,
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)
from shared import tracing
from shared.bus import Bus
from shared.clients import (
    ClusterClient,
    Heartbeater,
    JobExecutorClient,
    ScalerClient,
    TaskExecutorClient,
    ViewWatcher,
)
from shared.errors import BadRequest, MeshserveError, NotFound, PayloadTooLarge, Unavailable
from shared.file_store import FileStore
from shared.fine_tuning import Adapter, FineTuneStore
from shared.logging import get_logger
from shared.messages.auth import KeyRevoked
from shared.messages.cluster import FEHeartbeat, MemberDown
from shared.messages.scaling import OutcomeReport, ScaleEvent
from shared.metrics_http import metrics_response
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects
from shared.tenancy import TenantStore

log = get_logger(__name__)

OPENAPI = web.AppKey("openapi_json", bytes)

DASHBOARD = (Path(__file__).parent / "static" / "dashboard.html").read_bytes()
OUTCOME_REPORT_S = 1.0
LISTEN_BACKLOG = 4096


class Frontend:
    def __init__(self, *, settings: Settings, bus: Bus, store: Store | None = None) -> None:
        self._settings = settings
        self._bus = bus
        self._store = store
        self._subjects = Subjects(settings.cluster)
        tenants = TenantStore(store, settings.cluster) if store is not None else None
        self._auth = Authenticator(settings, tenants)
        self._limiter = Limiter(store, settings.cluster, settings.limits.lease.total_seconds())
        self._admin = AdminAPI(tenants, self._auth, bus, self._subjects)
        files = settings.files
        self._files = FilesAPI(
            FileStore(
                store,
                settings.cluster,
                files.directory(settings.cluster),
                max_bytes=files.max_bytes,
                quota_bytes=files.quota_bytes,
            )
            if store is not None
            else None
        )
        ft_store = FineTuneStore(store, settings.cluster) if store is not None else None
        self._adapters = AdapterCatalog(ft_store)
        self._fine_tuning = FineTuningAPI(
            ft_store,
            self._files.store,
            model=self._model,
            read_body=self._body,
            bus=bus,
            subjects=self._subjects,
        )
        self.frontend_id = f"fe-{uuid.uuid4().hex[:8]}"
        self._life = Lifecycle("frontend")
        self._view = ViewWatcher(bus, self._subjects)
        self._catalog = ModelCatalog(self._view)
        # Grace for a member missing from the view before it counts as gone without a notice
        # (a restarted cluster manager hears every heartbeat within one interval).
        self._liveness = Liveness(
            grace_s=2 * settings.membership.heartbeat_interval.total_seconds()
        )
        self._view.listeners.append(self._liveness.on_view)
        self._view.listeners.append(LeaseEnds().on_view)
        self._router = StreamRouter(self.frontend_id, self._subjects, self._liveness)
        self._jobs = JobExecutorClient(bus, self._subjects)
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._scaler = ScalerClient(bus, self._subjects)
        self._outcomes = Outcomes(settings.scaler.slo())
        self._stalls = StallGuard(settings.frontend.stall_timeout.total_seconds())
        self._recent = Recent()  # what this frontend saw lately, for an operator's status
        self._answers = Answerer(
            stalls=self._stalls, life=self._life, outcomes=self._outcomes, recent=self._recent
        )
        self.port: int | None = None
        self._started = time.time()
        # Its liveness lets TEs stop the generations of a frontend that died.
        self._hb = Heartbeater(
            ClusterClient(bus, self._subjects),
            self._heartbeat,
            settings.membership.heartbeat_interval.total_seconds(),
        )
        bus.on_disconnected.append(self._on_bus_down)
        bus.on_reconnected.append(self._on_bus_back)
        self._bus_down_timer: asyncio.TimerHandle | None = None
        self._bus_lost: Unavailable | None = None  # the bus is down past its grace

    def app(self) -> web.Application:
        limit = self._settings.frontend.max_body_bytes
        app = web.Application(
            middlewares=[
                errors_middleware,
                auth_middleware(self._auth, self._settings.files.max_bytes),
            ],
            client_max_size=limit,
        )
        app[MAX_BODY] = limit
        self._admin.routes(app)
        self._files.routes(app)
        self._fine_tuning.routes(app)
        app[OPENAPI] = R.json_body(openapi_document(limit))
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/admin/status", self.status)
        app.router.add_get("/dashboard", self.dashboard)
        app.router.add_get("/metrics", metrics_response)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    async def run(self) -> None:
        await self._view.start(self._life)
        await self._bus.subscribe(
            self._subjects.key_revoked(), {KeyRevoked: self._auth.on_key_revoked}
        )
        self._life.spawn(self._limiter.renew_forever(), name="lease renewer")
        self._hb.start(self._life)
        await self._bus.subscribe(self._subjects.member_down(), {MemberDown: self._on_member_down})
        await self._bus.subscribe(self._subjects.scale_events(), {ScaleEvent: self._on_scale})
        self._life.spawn(self._report_outcomes(), name="outcome reporter")
        self._life.spawn(self._stalls.run(), name="stall guard")
        # Every stream's tokens come through this one subscription: none may be dropped
        # for a backlog (the client library's default), what waits is bounded per stream.
        await self._bus.subscribe_raw(
            self._subjects.token_streams(self.frontend_id), self._router.on_msg, unbounded=True
        )
        files = raise_open_files_limit()
        runner = web.AppRunner(
            self.app(),
            access_log=None,
            shutdown_timeout=self._settings.membership.shutdown_grace.total_seconds(),
            # A client that hangs up cancels its handler, whose cleanup cancels the
            # generation on its TE instead of running it to max_tokens for nobody.
            handler_cancellation=True,
        )
        await runner.setup()
        site = web.TCPSite(
            runner,
            self._settings.frontend.http_host,
            self._settings.frontend.http_port,
            # Thousands of clients may connect at once (the kernel caps it at somaxconn).
            backlog=LISTEN_BACKLOG,
        )
        await site.start()
        self.port = runner.addresses[0][1]
        log.info(
            "listening",
            url=f"http://{self._settings.frontend.http_host}:{self.port}/v1",
            open_files_limit=files,
        )
        try:
            await self._life.wait()
        finally:
            # Stop accepting (a listener closed stays closed), give the streams the grace
            # period, end those still running with an error event, then let the other
            # in-flight requests finish within the grace period.
            await site.stop()
            grace = self._settings.membership.shutdown_grace.total_seconds()
            if await self._stalls.drain(grace):
                self._stalls.interrupt_all()
                await self._stalls.drain(2.0)
            await runner.cleanup()
            self._liveness.close()
            await self._life.cancel_tasks()
            with contextlib.suppress(MeshserveError):
                await ClusterClient(self._bus, self._subjects).leave(self.frontend_id)
            if self._store is not None:
                await self._store.close()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    def _heartbeat(self) -> FEHeartbeat:
        return FEHeartbeat(
            frontend_id=self.frontend_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self._started,
            streams=self._stalls.streams,
        )

    async def _on_member_down(self, msg: MemberDown) -> None:
        self._liveness.on_member_down(msg)

    def _on_bus_down(self) -> None:
        """NATS is gone. Token streams stop; a request must not wait out its whole timeout
        for a bus that may not come back: past one liveness deadline (what a member gets
        before its requests move) and the time the client takes to move to another server of
        the cluster, the requests in flight fail with a 503."""
        if self._bus_down_timer is None and not self._life.stopping:
            grace = self._settings.membership.liveness_timeout.total_seconds()
            self._bus_down_timer = asyncio.get_running_loop().call_later(
                grace + self._bus.failover_s, self._bus_gone
            )

    def _bus_gone(self) -> None:
        self._bus_lost = Unavailable(
            "The cluster's message bus is unreachable; retry later.",
            retry_after_s=self._settings.job_executor.retry_after.total_seconds(),
        )
        self._router.interrupt_all(self._bus_lost)

    def _on_bus_back(self) -> None:
        """NATS is back, the subscriptions with it; what was in flight meanwhile is lost, so
        every request in flight is resubmitted with the tokens it has (greedy output goes on
        exactly where it stopped)."""
        if self._bus_down_timer is not None:
            self._bus_down_timer.cancel()
            self._bus_down_timer = None
        self._bus_lost = None
        self._router.interrupt_all(None)

    async def _report_outcomes(self) -> None:
        while True:
            await asyncio.sleep(OUTCOME_REPORT_S)
            if models := self._outcomes.take():
                try:
                    await self._scaler.outcomes(
                        OutcomeReport(frontend_id=self.frontend_id, models=models)
                    )
                except MeshserveError as e:
                    log.warning("outcome report failed", error=str(e))

    # -- endpoints -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        view = self._view.view
        ok = self._bus.connected and view.version >= 0
        body = {
            "status": "ok" if ok else "starting",
            "models": [m.id for m in view.models],
            "task_executors": [
                {
                    "id": te.te_id,
                    "state": str(te.state),
                    "model": te.model,
                    "role": str(te.role),
                    "engine": te.engine,
                    "engine_reason": te.engine_reason,
                    "device": te.device,
                    "pool": te.pool_id,
                    "host": te.host,
                    "pid": te.pid,
                    "running": te.running,
                    "waiting": te.waiting,
                    "generated_tokens": te.generated_tokens,
                    "capabilities": msgspec.to_builtins(te.engine_capabilities),
                    "weight_server": te.weight_server,
                    "cached_weights": msgspec.to_builtins(te.cached_weights),
                }
                for te in view.tes
            ],
            "job_executors": len(view.jes),
        }
        return web.json_response(body, status=200 if ok else 503)

    async def status(self, request: web.Request) -> web.Response:
        """The cluster for an operator (``status.py``): the admin's, when auth is on."""
        principal_of(request).require_admin()
        now = time.time()
        body = cluster_status(
            self._view.view,
            now,
            traffic=self._recent.models(now),
            scale_events=self._recent.scale_events(),
        )
        return web.json_response(body)

    async def dashboard(self, request: web.Request) -> web.Response:
        """The status page: plain HTML and a small script that polls ``/admin/status``;
        its policy forbids fetching anything from anywhere else."""
        return web.Response(
            body=DASHBOARD,
            content_type="text/html",
            headers={
                "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                "style-src 'unsafe-inline'; connect-src 'self'; form-action 'none'",
                "Cache-Control": "no-cache",
            },
        )

    async def _on_scale(self, msg: ScaleEvent) -> None:
        await on_scale_event(msg)
        self._recent.scale_event(msg, time.time())

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=request.app[OPENAPI], content_type="application/json")

    def _model_obj(self, m: Any) -> dict[str, Any]:
        return {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": m.owned_by,
            "max_model_len": m.max_context,
            # whether an instance serves it now, one is loading, or it is at zero
            **model_state(m.id, self._view.view.tes).fields(),
        }

    def _adapter_obj(self, a: Adapter) -> dict[str, Any]:
        base = self._model_obj(self._catalog.get(a.base))
        return {**base, "id": a.name, "created": a.created, "owned_by": a.tenant, "parent": a.base}

    async def list_models(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        models = [m for m in self._catalog.models() if principal.may_use(m.id)]
        data = [self._model_obj(m) for m in models]
        served = {m.id for m in models}
        adapters = await self._adapters.owned(principal.tenant, admin=principal.admin)
        data += [self._adapter_obj(a) for a in adapters if a.base in served]
        return web.json_response({"object": "list", "data": data})

    def _model(self, request: web.Request, model: str) -> Any:
        """The model's info, if it exists and the caller may use it; the same 404 if not."""
        info = self._catalog.get(model)
        if not principal_of(request).may_use(model):
            raise NotFound(
                f"The model `{model}` does not exist.", param="model", code="model_not_found"
            )
        return info

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        """The body, held to the caller's own size limit: a chunked body has no
        Content-Length for the middleware to check."""
        body = await request.read()
        limit = principal_of(request).limits.max_body_bytes
        if len(body) > limit:
            raise PayloadTooLarge(f"The request body exceeds {limit} bytes.")
        return body

    async def _served(self, request: web.Request, model: str) -> tuple[Any, Adapter | None]:
        """The base model's info and, for a fine-tuned model, its adapter; the same 404 for
        a model that does not exist, one the caller may not use, another tenant's."""
        if not is_fine_tuned(model):
            return self._model(request, model), None
        principal = principal_of(request)
        adapter = await self._adapters.get(model, principal.tenant, admin=principal.admin)
        return self._model(request, adapter.base), adapter

    async def get_model(self, request: web.Request) -> web.Response:
        info, adapter = await self._served(request, request.match_info["model"])
        if adapter is not None:
            return web.json_response(self._adapter_obj(adapter))
        return web.json_response(self._model_obj(info))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await self._body(request))
        info, adapter = await self._served(request, req.model)
        tok = await self._catalog.tokenizer(info)
        messages = req.template_messages()
        check_text_size(
            sum(len(m.get("content") or "") for m in messages), info.max_context, "messages"
        )
        try:
            # Off the event loop: a long prompt must not stall every other stream.
            prompt = await asyncio.to_thread(tok.encode_chat, messages, add_generation_prompt=True)
        except MeshserveError:
            raise
        except Exception as e:  # a template may raise_exception() on messages it rejects
            raise BadRequest(
                f"The messages do not fit the model's chat template: {e}", param="messages"
            ) from e
        return await self._generate(request, req, info, tok, prompt, chat=True, adapter=adapter)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(await self._body(request))
        info, adapter = await self._served(request, req.model)
        tok = await self._catalog.tokenizer(info)
        p = req.prompt_input()
        if isinstance(p, str):
            check_text_size(len(p), info.max_context, "prompt")
            prompt = await asyncio.to_thread(tok.encode, p)
        else:
            prompt = p
        vocab = tok.vocab_size
        if any(t >= vocab for t in prompt):
            raise BadRequest(
                f"Token ids must be below the vocabulary size {vocab}.", param="prompt"
            )
        return await self._generate(request, req, info, tok, prompt, chat=False, adapter=adapter)

    # -- generation ----------------------------------------------------------------------

    async def _generate(
        self,
        request: web.Request,
        req: ChatCompletionRequest | CompletionRequest,
        info: Any,
        tok: Any,
        prompt: list[int],
        *,
        chat: bool,
        adapter: Adapter | None,
    ) -> web.StreamResponse:
        principal = principal_of(request)
        sampling = check_sizes(
            principal.limits,
            req,
            sampling_params(
                req,
                prompt_tokens=len(prompt),
                max_context=info.max_context,
                eos_token_ids=tok.eos_token_ids,
            ),
            prompt_tokens=len(prompt),
            param="messages" if chat else "prompt",
        )
        if self._bus_lost is not None:  # a new request would wait for the bus as long
            raise self._bus_lost
        rid = R.chat_id() if chat else R.completion_id()
        # Every log line about this request, in every service, carries its id (the one the
        # client gets back); the bus carries it to the job executor and the TE.
        with structlog.contextvars.bound_contextvars(request_id=rid):
            log.debug(
                "request accepted",
                model=req.model,
                prompt_tokens=len(prompt),
                max_tokens=sampling.max_tokens,
                stream=req.is_stream,
            )
            lease = await self._admit(principal, rid, len(prompt))
            try:
                gen = Generation(
                    request_id=rid,
                    model=req.model,
                    base_model=info.id,
                    adapter=adapter.name if adapter is not None else "",
                    adapter_path=adapter.path if adapter is not None else "",
                    tenant=principal.tenant,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    settings=self._settings,
                    router=self._router,
                    jobs=self._jobs,
                    tes=self._tes,
                )
                with traced(gen, chat=chat):
                    return await self._answers.answer(request, req, gen, tok, lease, chat=chat)
            finally:
                await asyncio.shield(lease.release())

    async def _admit(self, principal: Principal, rid: str, prompt_tokens: int) -> Lease:
        if not principal.limited:
            return Lease(None, principal.tenant, rid, principal.limits)
        return await self._limiter.admit(principal.tenant, principal.limits, rid, prompt_tokens)


@contextlib.contextmanager
def traced(gen: Generation, *, chat: bool) -> Iterator[None]:
    """The request's span (GenAI conventions: ``{operation} {model}``), the parent of the
    job executor's and the TE's: the bus carries its context."""
    operation = "chat" if chat else "text_completion"
    start = time.monotonic()
    with tracing.tracer().start_as_current_span(
        f"{operation} {gen.model}",
        kind=SpanKind.SERVER,
        attributes={
            tracing.OPERATION: operation,
            tracing.REQUEST_MODEL: gen.model,
            tracing.REQUEST_ID: gen.request_id,
        },
    ) as span:
        try:
            yield
        finally:
            if span.is_recording():
                span.set_attribute(tracing.INPUT_TOKENS, len(gen.prompt_token_ids))
                span.set_attribute(tracing.OUTPUT_TOKENS, len(gen.generated))
                span.set_attribute(tracing.FINISH_REASONS, [gen.finish_reason or "abort"])
                if gen.first_token_at is not None:
                    span.set_attribute(tracing.TIME_TO_FIRST_TOKEN, gen.first_token_at - start)


async def create(settings: Settings, bus: Bus) -> Frontend:
    store = await Store.for_settings(settings) if settings.redis_url else None
    return Frontend(settings=settings, bus=bus, store=store)

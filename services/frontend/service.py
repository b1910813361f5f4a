"""The frontend: the OpenAI-compatible HTTP API (aiohttp). It validates, tokenizes with
the model's own chat template, submits the job to a job executor and streams the TE's
tokens back to the client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from services.frontend import responses as R
from services.frontend.admin import AdminAPI
from services.frontend.auth import PRINCIPAL, Authenticator, Principal, principal_of
from services.frontend.catalog import ModelCatalog
from services.frontend.generation import Generation, StreamRouter
from services.frontend.liveness import Liveness
from services.frontend.openai_types import ChatCompletionRequest, CompletionRequest
from services.frontend.openapi import document as openapi_document
from services.frontend.outcomes import Outcomes
from services.frontend.rate_limits import Lease, Limiter, check_sizes
from services.frontend.stop import StopMatcher
from services.frontend.streaming import (
    STREAM_DELAY,
    StallGuard,
    raise_open_files_limit,
)
from services.frontend.validation import (
    parse_chat_request,
    parse_completion_request,
    sampling_params,
)
from shared.bus import Bus
from shared.clients import (
    ClusterClient,
    Heartbeater,
    JobExecutorClient,
    ScalerClient,
    TaskExecutorClient,
    ViewWatcher,
)
from shared.errors import (
    BadRequest,
    Internal,
    MeshserveError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    Unavailable,
)
from shared.logging import get_logger
from shared.messages.api import SamplingParams
from shared.messages.auth import KeyRevoked
from shared.messages.cluster import FEHeartbeat, MemberDown
from shared.messages.scaling import OutcomeReport, ScaleEvent
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects
from shared.tenancy import TenantStore

log = get_logger(__name__)

MAX_BODY = web.AppKey("max_body_bytes", int)
ARRIVED = "meshserve.arrived"  # a request's key: when the frontend began on it (monotonic)
OPENAPI = web.AppKey("openapi_json", bytes)

REQUESTS = Counter("meshserve_http_requests", "HTTP requests", ["endpoint", "status"])
TTFT = Histogram(
    "meshserve_ttft_seconds",
    "Time to first token",
    ["model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
TOKENS = Counter("meshserve_generated_tokens", "Tokens generated", ["model"])
CLIENT_GONE = Counter("meshserve_client_disconnects", "Clients that hung up before the end")
SLO_MET = Counter(
    "meshserve_slo_requests", "Finished requests, by whether they met the SLO", ["model", "met"]
)
HELD = Counter(
    "meshserve_held_requests", "Requests held while their model scaled up or out", ["model"]
)
HELD_WAIT = Histogram(
    "meshserve_held_wait_seconds",
    "How long a held request waited for an instance",
    ["model"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60),
)
SCALE_EVENTS = Counter(
    "meshserve_scale_events", "Scale-ups and scale-downs done", ["kind", "model", "ok"]
)
SCALE_STEP = Histogram(
    "meshserve_scale_step_seconds",
    "Time of each step of a scale event (DeepServe's five for a scale-up)",
    ["kind", "step"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120),
)
ROUTED = Counter(
    "meshserve_routing_decisions",
    "Requests placed, by the routing branch that chose the TE and whether the prompt index "
    "said it held a prefix of the prompt",
    ["model", "branch", "hit"],
)
ROUTED_TOKENS = Counter(
    "meshserve_routing_prompt_tokens",
    "Prompt tokens of placed requests: all of them (prompt), the leading ones the prompt index "
    "matched on the chosen TE (matched) and on the ready TE holding the most (best: what an "
    "oracle router would reuse), and those the chosen TE's prefix cache actually held (cached)",
    ["model", "kind"],
)
PHASE = Histogram(
    "meshserve_request_phase_seconds",
    "Where a request's time to first token goes: in the frontend before the job is submitted "
    "(parse, auth, validation, tokenization, limits: frontend_in), job submitted to placed "
    "(placement; of it, the job executor's own time: je), placed to first token at the "
    "frontend (first_token; of it, the TE's own time from the task accepted to the token "
    "sent: te), first token to its bytes handed to the client (frontend_out)",
    ["phase"],
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
)
SHED = Counter(
    "meshserve_shed_requests",
    "Requests refused at admission because every instance was saturated and none was coming",
)
OUTCOME_REPORT_S = 1.0
LISTEN_BACKLOG = 4096


def _reason(gen: Generation, stops: StopMatcher, lease: Lease) -> str:
    """The finish reason the client sees. The OpenAI schema knows only these two for a
    completed generation; a tenant's token budget running out is a length limit."""
    if stops.stopped:
        return "stop"
    if lease.exhausted or gen.finish_reason == "length":
        return "length"
    return "stop"


# No tokenizer packs more characters than this into one token; a text longer than the
# context times this cannot fit, so it is refused before the (costly) tokenization.
MAX_CHARS_PER_TOKEN = 64


def _check_text_size(chars: int, max_context: int, param: str) -> None:
    if chars > max_context * MAX_CHARS_PER_TOKEN:
        raise BadRequest(
            f"This model's maximum context length is {max_context} tokens. However, your "
            f"{param} hold {chars} characters, more than any {max_context}-token text. Please "
            f"reduce the length of the {param}.",
            param=param,
            code="context_length_exceeded",
        )


def _error_response(err: MeshserveError) -> web.Response:
    headers = dict(err.headers)
    if err.status in (429, 503) and err.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(err.retry_after_s)))
    return web.Response(
        status=err.status,
        body=R.json_body(R.error_body(err)),
        content_type="application/json",
        headers=headers,
    )


@web.middleware
async def errors_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as an OpenAI-style JSON body, never as a stack trace."""
    request[ARRIVED] = time.monotonic()
    endpoint = (
        request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
    )
    try:
        resp = await handler(request)
    except MeshserveError as e:
        if e.code == "overloaded":
            SHED.inc()
        resp = _error_response(e)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY]
        resp = _error_response(PayloadTooLarge(f"The request body exceeds {limit} bytes."))
    except web.HTTPNotFound:
        resp = _error_response(NotFound(f"Unknown request URL: {request.method} {request.path}."))
    except web.HTTPMethodNotAllowed as e:
        resp = _error_response(
            MethodNotAllowed(f"Method {request.method} is not allowed on {request.path}.")
        )
        resp.headers["Allow"] = ",".join(sorted(e.allowed_methods))
    except web.RequestPayloadError as e:
        # request.read() could not decode the body (a Content-Encoding it is not in, broken
        # chunked framing): the client's fault, raised as a plain exception, not a 400.
        cause = e.__cause__
        why = cause.message if isinstance(cause, HttpProcessingError) else "it is malformed"
        resp = _error_response(BadRequest(f"The request body could not be read: {why}."))
    except web.HTTPException:
        raise
    except Exception:
        log.exception("unhandled error", path=request.path)
        resp = _error_response(Internal("The server had an error processing your request."))
    REQUESTS.labels(endpoint, str(resp.status)).inc()
    return resp


# Paths anyone may call: probes, metrics, the API's description.
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")


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
        self._router = StreamRouter(self.frontend_id, self._subjects, self._liveness)
        self._jobs = JobExecutorClient(bus, self._subjects)
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._scaler = ScalerClient(bus, self._subjects)
        self._outcomes = Outcomes(settings.scaler.slo())
        self._stalls = StallGuard(settings.frontend.stall_timeout.total_seconds())
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
            middlewares=[errors_middleware, self._auth_middleware], client_max_size=limit
        )
        app[MAX_BODY] = limit
        self._admin.routes(app)
        app[OPENAPI] = R.json_body(openapi_document(limit))
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{model:.+}", self.get_model)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        return app

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            principal = await self._auth.principal(request)
            request[PRINCIPAL] = principal
            if (size := request.content_length) and size > principal.limits.max_body_bytes:
                raise PayloadTooLarge(
                    f"The request body exceeds {principal.limits.max_body_bytes} bytes."
                )
        resp: web.StreamResponse = await handler(request)
        return resp

    async def run(self) -> None:
        await self._view.start(self._life)
        await self._bus.subscribe(
            self._subjects.key_revoked(), {KeyRevoked: self._auth.on_key_revoked}
        )
        self._life.spawn(self._limiter.renew_forever(), name="lease renewer")
        self._hb.start(self._life)
        await self._bus.subscribe(self._subjects.member_down(), {MemberDown: self._on_member_down})
        await self._bus.subscribe(self._subjects.scale_events(), {ScaleEvent: self._on_scale_event})
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
        before its requests move), the requests in flight fail with a 503."""
        if self._bus_down_timer is None and not self._life.stopping:
            self._bus_down_timer = asyncio.get_running_loop().call_later(
                self._settings.membership.liveness_timeout.total_seconds(), self._bus_gone
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

    async def _on_scale_event(self, msg: ScaleEvent) -> None:
        SCALE_EVENTS.labels(msg.kind, msg.model, str(msg.ok).lower()).inc()
        for step, seconds in msg.steps.items():
            SCALE_STEP.labels(msg.kind, step).observe(seconds)

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

    async def metrics(self, request: web.Request) -> web.Response:
        resp = web.Response(body=generate_latest())
        resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return resp

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=request.app[OPENAPI], content_type="application/json")

    def _model_obj(self, m: Any) -> dict[str, Any]:
        return {
            "id": m.id,
            "object": "model",
            "created": m.created,
            "owned_by": m.owned_by,
            "max_model_len": m.max_context,
        }

    async def list_models(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        models = [m for m in self._catalog.models() if principal.may_use(m.id)]
        return web.json_response({"object": "list", "data": [self._model_obj(m) for m in models]})

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

    async def get_model(self, request: web.Request) -> web.Response:
        return web.json_response(self._model_obj(self._model(request, request.match_info["model"])))

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await self._body(request))
        info = self._model(request, req.model)
        tok = await self._catalog.tokenizer(info)
        messages = req.template_messages()
        _check_text_size(
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
        return await self._generate(request, req, info, tok, prompt, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(await self._body(request))
        info = self._model(request, req.model)
        tok = await self._catalog.tokenizer(info)
        p = req.prompt_input()
        if isinstance(p, str):
            _check_text_size(len(p), info.max_context, "prompt")
            prompt = await asyncio.to_thread(tok.encode, p)
        else:
            prompt = p
        vocab = tok.vocab_size
        if any(t >= vocab for t in prompt):
            raise BadRequest(
                f"Token ids must be below the vocabulary size {vocab}.", param="prompt"
            )
        return await self._generate(request, req, info, tok, prompt, chat=False)

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
                return await self._run(request, req, tok, prompt, sampling, rid, lease, chat=chat)
            finally:
                await asyncio.shield(lease.release())

    async def _admit(self, principal: Principal, rid: str, prompt_tokens: int) -> Lease:
        if not principal.limited:
            return Lease(None, principal.tenant, rid, principal.limits)
        return await self._limiter.admit(principal.tenant, principal.limits, rid, prompt_tokens)

    async def _run(
        self,
        request: web.Request,
        req: ChatCompletionRequest | CompletionRequest,
        tok: Any,
        prompt: list[int],
        sampling: SamplingParams,
        rid: str,
        lease: Lease,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        gen = Generation(
            request_id=rid,
            model=req.model,
            prompt_token_ids=prompt,
            sampling=sampling,
            settings=self._settings,
            router=self._router,
            jobs=self._jobs,
            tes=self._tes,
        )
        created = int(time.time())
        t0 = time.monotonic()
        detok = tok.detokenizer(prompt)
        stops = StopMatcher(req.stop_strings)
        pieces = self._texts(gen, detok, stops, lease)
        try:
            if req.is_stream:
                return await self._stream(
                    request, req, gen, pieces, stops, lease, rid, created, t0, chat=chat
                )
            text = "".join([p async for p in pieces])
            _phases(request[ARRIVED], t0, gen)
        finally:
            await pieces.aclose()
            await gen.cancel()
            self._account(req.model, gen, len(prompt), t0)
            log.debug(
                "request finished",
                completion_tokens=len(gen.generated),
                finish_reason=gen.finish_reason,
                seconds=round(time.monotonic() - t0, 3),
            )
        usage = R.usage(len(prompt), len(gen.generated), gen.cached_tokens)
        build = R.chat_completion if chat else R.completion
        return web.Response(
            body=R.json_body(
                build(rid, req.model, created, text, _reason(gen, stops, lease), usage)
            ),
            content_type="application/json",
            headers=lease.headers,
        )

    def _account(self, model: str, gen: Generation, prompt_tokens: int, t0: float) -> None:
        n = len(gen.generated)
        ttft = None if gen.first_token_at is None else gen.first_token_at - t0
        tpot = None
        if n > 1 and gen.first_token_at is not None and gen.last_token_at is not None:
            tpot = (gen.last_token_at - gen.first_token_at) / (n - 1)
        if ttft is not None:
            TTFT.labels(model).observe(ttft)
        TOKENS.labels(model).inc(n)
        if gen.held_s is not None:
            HELD.labels(model).inc()
            HELD_WAIT.labels(model).observe(gen.held_s)
        if (routed := gen.routed) is not None:
            hit = "yes" if routed.matched_tokens else "no"
            ROUTED.labels(model, routed.routing or "none", hit).inc()
            ROUTED_TOKENS.labels(model, "prompt").inc(prompt_tokens)
            ROUTED_TOKENS.labels(model, "matched").inc(routed.matched_tokens)
            ROUTED_TOKENS.labels(model, "best").inc(routed.best_matched_tokens)
            ROUTED_TOKENS.labels(model, "cached").inc(gen.cached_tokens)
        met = self._outcomes.record(
            model,
            ok=gen.finish_reason is not None,
            prompt_tokens=prompt_tokens,
            output_tokens=n,
            ttft_s=ttft,
            tpot_s=tpot,
        )
        SLO_MET.labels(model, str(met).lower()).inc()

    @staticmethod
    async def _texts(
        gen: Generation, detok: Any, stops: StopMatcher, lease: Lease
    ) -> AsyncGenerator[str, None]:
        """Text deltas of the generation, up to (not including) the first stop string, or
        until the tenant's token budget runs out."""
        async for ids in gen.tokens():
            within = await lease.charge(len(ids))
            text, hit = stops.push(detok.push(ids))
            if text:
                yield text
            if hit or not within:
                return
        text, _ = stops.push(detok.flush())
        if text:
            yield text
        if not stops.stopped and (tail := stops.flush()):
            yield tail

    async def _stream(
        self,
        request: web.Request,
        req: Any,
        gen: Generation,
        pieces: Any,
        stops: StopMatcher,
        lease: Lease,
        rid: str,
        created: int,
        started: float,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        # Place the job before committing to a 200: a job that cannot be placed must get
        # its 404/503 as a proper status, not as an event inside a stream.
        first: str | None = None
        done = False
        try:
            first = await anext(pieces)
        except StopAsyncIteration:
            done = True
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **lease.headers,
            }
        )
        await resp.prepare(request)

        def chunk(text: str | None, finish: str | None = None) -> bytes:
            if chat:
                delta = {} if text is None else {"content": text}
                return R.sse(
                    R.chat_chunk(rid, req.model, created, delta=delta, finish_reason=finish)
                )
            return R.sse(
                R.completion_chunk(rid, req.model, created, text=text or "", finish_reason=finish)
            )

        # A client that reads nothing for stall_timeout is cut (streaming.StallGuard).
        with self._stalls.open(resp, request, rid) as out:
            try:
                if chat:
                    await out.write(
                        R.sse(
                            R.chat_chunk(
                                rid, req.model, created, delta={"role": "assistant", "content": ""}
                            )
                        )
                    )
                if first:
                    await out.write(chunk(first))
                    _phases(request[ARRIVED], started, gen)
                if not done:
                    async for text in pieces:
                        if gen.arrived_at is not None:
                            STREAM_DELAY.observe(time.monotonic() - gen.arrived_at)
                        await out.write(chunk(text))
                await out.write(chunk(None, _reason(gen, stops, lease)))
                if req.include_usage:
                    usage = R.usage(
                        len(gen.prompt_token_ids), len(gen.generated), gen.cached_tokens
                    )
                    await out.write(R.sse(R.usage_chunk(rid, req.model, created, usage, chat=chat)))
                await out.write(R.SSE_DONE)
            except MeshserveError as e:
                with contextlib.suppress(ConnectionError):
                    await out.write(R.sse(R.error_body(e)))
                    await out.write(R.SSE_DONE)
            except ConnectionError:
                # The client hung up mid-stream: nothing to answer; _generate cancels the task.
                log.info("client went away", request_id=rid)
                CLIENT_GONE.inc()
            except asyncio.CancelledError:
                if self._life.stopping:
                    # The frontend stops and its grace is over: the stream ends with an error
                    # event the client can act on, not with a connection cut mid-event.
                    gone = Unavailable(
                        "The server is shutting down; retry the request.", retry_after_s=1
                    )
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(
                            resp.write(R.sse(R.error_body(gone)) + R.SSE_DONE), 1.0
                        )
                raise
        return resp


def _phases(arrived: float, submitted: float, gen: Generation) -> None:
    """``PHASE``: a request's first token, handed to the client now, by where it went."""
    if gen.accepted_at is None or gen.first_token_at is None or gen.held_s is not None:
        return  # held for capacity: a scale-up, not serving overhead
    now = time.monotonic()
    PHASE.labels("frontend_in").observe(submitted - arrived)
    PHASE.labels("placement").observe(gen.accepted_at - submitted)
    if gen.routed is not None:
        PHASE.labels("je").observe(gen.routed.je_s)
    PHASE.labels("first_token").observe(gen.first_token_at - gen.accepted_at)
    PHASE.labels("te").observe(gen.te_s)
    PHASE.labels("frontend_out").observe(now - gen.first_token_at)


async def create(settings: Settings, bus: Bus) -> Frontend:
    store = await Store.connect(settings.redis_url) if settings.redis_url else None
    return Frontend(settings=settings, bus=bus, store=store)

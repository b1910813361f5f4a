"""OpenAI's fine-tuning API (``shared.fine_tuning``): the official client's
``fine_tuning.jobs.create/list/retrieve/cancel/list_events`` and
``fine_tuning.jobs.checkpoints.list`` work unchanged.

    POST /v1/fine_tuning/jobs                         -> the job (validating_files)
    GET  /v1/fine_tuning/jobs[?after&limit&metadata[k]=v]
    GET  /v1/fine_tuning/jobs/{job_id}
    POST /v1/fine_tuning/jobs/{job_id}/cancel
    GET  /v1/fine_tuning/jobs/{job_id}/events[?after&limit]        newest first
    GET  /v1/fine_tuning/jobs/{job_id}/checkpoints[?after&limit]   newest first

A job is checked here (the base model exists and the tenant may use it; its files exist,
belong to the tenant and are fine-tuning data; the hyperparameters), recorded, and announced
to the job executors, which run it on idle TEs. A tenant sees its own jobs only. Needs
Redis."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from services.frontend.auth import Principal, principal_of
from services.frontend.validation import decode_json
from shared.bus import Bus
from shared.errors import BadRequest, NotFound, Unavailable
from shared.file_store import FileStore
from shared.fine_tuning import (
    AUTO,
    LIVE,
    FineTuneJob,
    FineTuneStore,
    Hyperparameters,
    JobStatus,
    new_id,
    page,
)
from shared.messages.cluster import ModelInfo
from shared.messages.training import FineTuneSubmitted
from shared.subjects import Subjects

JOBS_PATH = "/v1/fine_tuning/jobs"
MAX_PAGE = 100
SUFFIX = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
MAX_METADATA = 16
MAX_EPOCHS = 50
MAX_BATCH = 256


class Supervised(msgspec.Struct):
    hyperparameters: Hyperparameters | None = None


class Method(msgspec.Struct):
    type: str = "supervised"
    supervised: Supervised | None = None


class JobRequest(msgspec.Struct):
    model: str
    training_file: str
    validation_file: str | None = None
    hyperparameters: Hyperparameters | None = None
    method: Method | None = None
    suffix: str | None = None
    seed: int | None = None
    metadata: dict[str, str] | None = None
    integrations: list[Any] | None = None


_decoder = msgspec.json.Decoder(JobRequest)


def check_hyperparameters(hp: Hyperparameters) -> Hyperparameters:
    """Each one ``auto`` or a number in range; a 400 naming it otherwise."""
    checks: tuple[tuple[str, type, float, float], ...] = (
        ("n_epochs", int, 1, MAX_EPOCHS),
        ("batch_size", int, 1, MAX_BATCH),
        ("learning_rate_multiplier", float, 1e-6, 100.0),
    )
    for name, kind, low, high in checks:
        value = getattr(hp, name)
        if value == AUTO:
            continue
        if isinstance(value, str) or (kind is int and not isinstance(value, int)):
            raise BadRequest(
                f"`{name}` must be `auto` or a{'n integer' if kind is int else ' number'}.",
                param=f"hyperparameters.{name}",
            )
        if not low <= value <= high:
            raise BadRequest(
                f"`{name}` must be between {low:g} and {high:g}.", param=f"hyperparameters.{name}"
            )
    return hp


def parse_job_request(body: bytes) -> tuple[JobRequest, Hyperparameters]:
    req: JobRequest = decode_json(_decoder, body)
    if req.integrations:
        raise BadRequest("Integrations are not supported.", param="integrations")
    hp = req.hyperparameters
    if req.method is not None:
        if req.method.type != "supervised":
            raise BadRequest(
                f"Fine-tuning method `{req.method.type}` is not supported; only `supervised` "
                "(LoRA) is.",
                param="method.type",
            )
        if req.method.supervised is not None and req.method.supervised.hyperparameters:
            if hp is not None:
                raise BadRequest(
                    "Give the hyperparameters in `method` or at the top level, not both.",
                    param="hyperparameters",
                )
            hp = req.method.supervised.hyperparameters
    if req.suffix is not None and not SUFFIX.match(req.suffix):
        raise BadRequest("`suffix` must be 1 to 64 letters, digits, `-` or `_`.", param="suffix")
    if req.metadata is not None and len(req.metadata) > MAX_METADATA:
        raise BadRequest(f"`metadata` holds at most {MAX_METADATA} keys.", param="metadata")
    if req.seed is not None and not 0 <= req.seed < 2**31:
        raise BadRequest("`seed` must be between 0 and 2147483647.", param="seed")
    return req, check_hyperparameters(hp or Hyperparameters())


def _limit(request: web.Request, default: int = 20) -> int:
    raw = request.query.get("limit", str(default))
    try:
        limit = int(raw)
    except ValueError as e:
        raise BadRequest("`limit` must be an integer.", param="limit") from e
    if not 1 <= limit <= MAX_PAGE:
        raise BadRequest(f"`limit` must be between 1 and {MAX_PAGE}.", param="limit")
    return limit


def _page(items: list[Any], request: web.Request) -> web.Response:
    chunk, more = page(items, after=request.query.get("after"), limit=_limit(request))
    body = {"object": "list", "data": [i.openai() for i in chunk], "has_more": more}
    if chunk:
        body["first_id"], body["last_id"] = chunk[0].id, chunk[-1].id
    return web.json_response(body)


class FineTuningAPI:
    def __init__(
        self,
        jobs: FineTuneStore | None,
        files: FileStore | None,
        *,
        model: Callable[[web.Request, str], ModelInfo],
        read_body: Callable[[web.Request], Any],
        bus: Bus,
        subjects: Subjects,
    ) -> None:
        """``model``: the base model's info if it exists and the caller may use it (a 404
        otherwise); ``read_body``: the request body held to the caller's limit."""
        self._jobs, self._files = jobs, files
        self._model, self._read_body = model, read_body
        self._bus, self._subjects = bus, subjects

    def routes(self, app: web.Application) -> None:
        app.router.add_post(JOBS_PATH, self.create)
        app.router.add_get(JOBS_PATH, self.list)
        app.router.add_get(JOBS_PATH + "/{job_id}", self.retrieve)
        app.router.add_post(JOBS_PATH + "/{job_id}/cancel", self.cancel)
        app.router.add_get(JOBS_PATH + "/{job_id}/events", self.events)
        app.router.add_get(JOBS_PATH + "/{job_id}/checkpoints", self.checkpoints)

    def _store(self) -> FineTuneStore:
        if self._jobs is None:
            raise Unavailable("Fine-tuning needs the cluster's Redis (MESHSERVE_REDIS_URL).")
        return self._jobs

    async def _owned(self, request: web.Request) -> FineTuneJob:
        job_id = request.match_info["job_id"]
        job = await self._store().get(job_id)
        if job is None:
            raise NotFound(f"No such fine-tuning job: {job_id}.", code="fine_tune_job_not_found")
        return principal_of(request).check_owner(job, job.tenant, "fine-tuning job", job_id)

    async def _file(self, principal: Principal, file_id: str, param: str) -> None:
        assert self._files is not None
        obj = await self._files.get(file_id)
        if obj is None or not principal.owns(obj.tenant):
            raise NotFound(f"No such file: {file_id}.", param=param, code="file_not_found")
        if obj.purpose != "fine-tune":
            raise BadRequest(
                f"File {file_id} was uploaded with purpose `{obj.purpose}`, not `fine-tune`.",
                param=param,
            )

    async def create(self, request: web.Request) -> web.Response:
        store = self._store()
        principal = principal_of(request)
        req, hp = parse_job_request(await self._read_body(request))
        if req.model.startswith("ft:"):
            raise BadRequest(
                "Fine-tuning a fine-tuned model is not supported; name its base model.",
                param="model",
            )
        self._model(request, req.model)  # 404 unless it exists and the tenant may use it
        await self._file(principal, req.training_file, "training_file")
        if req.validation_file:
            await self._file(principal, req.validation_file, "validation_file")
        job = FineTuneJob(
            id=new_id("ftjob"),
            tenant=principal.tenant,
            model=req.model,
            training_file=req.training_file,
            validation_file=req.validation_file or None,
            created_at=int(time.time()),
            hyperparameters=hp,
            suffix=req.suffix,
            seed=req.seed if req.seed is not None else int(time.time()) % 2**31,
            metadata=req.metadata,
        )
        await store.create(job)
        await store.add_event(job.id, f"Created fine-tuning job: {job.id}")
        await self._announce(job.id)
        return web.json_response(job.openai())

    async def _announce(self, job_id: str) -> None:
        # Job executors also scan the active jobs every few seconds: a lost notice only
        # delays the job.
        await self._bus.publish(self._subjects.ft_submit(), FineTuneSubmitted(job_id=job_id))

    async def list(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        jobs = [j for j in await self._store().jobs() if principal.owns(j.tenant)]
        for key, value in request.query.items():
            if m := re.fullmatch(r"metadata\[(.+)\]", key):
                jobs = [j for j in jobs if (j.metadata or {}).get(m.group(1)) == value]
        return _page(jobs, request)

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response((await self._owned(request)).openai())

    async def cancel(self, request: web.Request) -> web.Response:
        job = await self._owned(request)
        store = self._store()
        # An adapter registered a moment before is withdrawn in the same transaction.
        cancelled = await store.update(
            job.id, LIVE, status=JobStatus.CANCELLED, withdraw=job.model_name()
        )
        if cancelled is None:
            now = await store.get(job.id)
            status = now.status if now is not None else "gone"
            raise BadRequest(
                f"Job {job.id} is {status}: only a job that has not ended can be cancelled.",
                code="invalid_state",
            )
        await store.add_event(job.id, "Fine-tuning job cancelled")
        await self._announce(job.id)  # its job executor stops the stage on its TE
        return web.json_response(cancelled.openai())

    async def events(self, request: web.Request) -> web.Response:
        job = await self._owned(request)
        events: list[Any] = list(reversed(await self._store().events(job.id)))
        return _page(events, request)

    async def checkpoints(self, request: web.Request) -> web.Response:
        job = await self._owned(request)
        checkpoints: list[Any] = list(reversed(await self._store().checkpoints(job.id)))
        return _page(checkpoints, request)

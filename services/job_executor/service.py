"""The job executor service."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import time
import uuid

import msgspec

from services.job_executor import metrics
from services.job_executor.admission import (
    INITIAL_MEAN_OUTPUT_TOKENS,
    device_busy,
    mean_output_tokens,
    shed,
)
from services.job_executor.disaggregation import (
    Demand,
    PdDecision,
    decide,
    pd_config,
    prefill_instances,
)
from services.job_executor.fine_tuning import FineTuneRunner
from services.job_executor.graph_keeper import GraphKeeper, Resumed, Running
from services.job_executor.holding import GiveUp, PendingJob, PlaceOn, next_step
from services.job_executor.kv_index import IndexFeed
from services.job_executor.ledger import PlacementLedger
from services.job_executor.output_length import OutputPredictor
from services.job_executor.placement import VALIDATED, Request, te_load
from services.job_executor.planner import DECODE, PREFILL, plan_chat, with_task
from services.job_executor.routing import RoutingConfig, spread_of
from services.job_executor.traffic import RateMeter, TrafficLedger
from services.views import TEView, te_view
from shared import block_hash, tracing
from shared.bus import Bus
from shared.clients import ClusterClient, Heartbeater, ScalerClient, TaskExecutorClient, ViewWatcher
from shared.errors import (
    DEVICE_BUSY,
    Deposed,
    Internal,
    MeshserveError,
    NoCapacity,
    NotFound,
    PeerUnreachable,
    Refused,
    Unavailable,
)
from shared.kv_index_store import KvIndexStore
from shared.logging import get_logger
from shared.messages.cluster import ClusterView, JEHeartbeat, TEState
from shared.messages.jobs import ChatJob, JobAccepted, JobHeld, JobTaken
from shared.messages.scaling import TrafficReport
from shared.messages.tasks import (
    ChatTask,
    KvSource,
    TaskAccepted,
    TaskMode,
    TaskProgress,
    attempt_key,
)
from shared.metrics_http import MetricsServer
from shared.native import Toolchain
from shared.runner import Lifecycle
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Subjects
from shared.task_graphs import GraphTask, TaskState, prompt_digest

log = get_logger(__name__)

REPORT_S = 0.5  # traffic reports to the scaler, while there is traffic
URGENT_MIN_S = 0.05  # an urgent report waits this long for others to join it


@dataclasses.dataclass(frozen=True, slots=True)
class Placed:
    """A job's graph placed (``task``: its streaming task; None: that TE did not take it),
    and the TEs that refused a task of it."""

    task: ChatTask | None
    source: KvSource | None
    pd: PdDecision
    refused: frozenset[str]


class JobExecutor:
    def __init__(self, *, settings: Settings, bus: Bus, store: Store | None = None) -> None:
        self._settings = settings
        self._bus = bus
        self._store = store
        self._subjects = Subjects(settings.cluster)
        self.je_id = f"je-{uuid.uuid4().hex[:8]}"
        self._life = Lifecycle("job_executor")
        je = settings.job_executor
        self._routing = RoutingConfig(
            policy=je.routing,
            balance_tokens=je.routing_balance_tokens,
        )
        self._speculative_ttl_s = je.routing_speculative_ttl.total_seconds()
        self._slo = settings.scaler.slo()  # a request's TTFT limit, for late binding
        self._pd = pd_config(je)
        self._feed = IndexFeed(
            bus,
            self._subjects,
            KvIndexStore(store, settings.cluster) if store is not None else None,
            fallback_block_size=je.routing_block_size,
        )
        self._round_robin = 0
        self._view = ViewWatcher(bus, self._subjects)
        self._view.listeners.append(self._on_view)
        self._view.listeners.append(self._feed.on_view)
        self._tes = TaskExecutorClient(bus, self._subjects)
        self._scaler = ScalerClient(bus, self._subjects)
        self._hb = Heartbeater(
            ClusterClient(bus, self._subjects),
            self._heartbeat,
            settings.membership.heartbeat_interval.total_seconds(),
        )
        # Each placement on each TE until the TE says it ended: what TE reports do not show.
        self._ledger = PlacementLedger(self.je_id)
        self._traffic = TrafficLedger()  # since the last report, and held now
        self._report_now = asyncio.Event()
        self._urgent = False
        self._views: list[TEView] = []
        self._views_of: ClusterView | None = None  # the view _views were made from
        self._inflight = 0
        # When each job in hand reached its frontend, on this JE's clock (its tasks' age).
        self._arrivals: dict[str, float] = {}
        # The TEs whose device refused each job in hand as too busy (shadow validation).
        self._busy: dict[str, set[str]] = {}
        self._started = time.time()
        self._mean_output_tokens = INITIAL_MEAN_OUTPUT_TOKENS  # admission's moving mean
        self._outputs = OutputPredictor()  # learns from the tasks it placed, as they end
        self._rates = RateMeter()  # each model's recent arrivals (PD's heat map)
        membership = settings.membership
        self._keeper = GraphKeeper(
            store,
            cluster=settings.cluster,
            je_id=self.je_id,
            liveness_s=membership.liveness_timeout.total_seconds(),
            heartbeat_s=membership.heartbeat_interval.total_seconds(),
            cancel=self._cancel_graph_task,
        )

        self._fine_tuning = FineTuneRunner(
            settings=settings.fine_tuning,
            cluster=settings.cluster,
            files_dir=settings.files.directory(settings.cluster),
            heartbeat_s=membership.heartbeat_interval.total_seconds(),
            liveness_s=membership.liveness_timeout.total_seconds(),
            bus=bus,
            subjects=self._subjects,
            store=store,
            keeper=self._keeper,
            je_id=self.je_id,
            view=lambda: self._view.view,
        )

    def _heartbeat(self) -> JEHeartbeat:
        return JEHeartbeat(
            je_id=self.je_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            started_at=self._started,
            inflight=self._inflight,
        )

    def _on_view(self, view: ClusterView) -> None:
        tes = self._te_views(view)
        for te in tes:
            self._ledger.report(te)
        self._ledger.keep_only({te.te_id for te in tes})

    async def _on_progress(self, msg: TaskProgress) -> None:
        for key in msg.prefilled:
            self._ledger.prefilled(key, msg.te_id)
        for key in msg.ended:
            self._ledger.ended(key, msg.te_id)
            self._outputs.ended(key, msg.outputs.get(key))

    async def run(self) -> None:
        await self._feed.start(self._life)
        await self._view.start(self._life)
        # Before taking jobs: the notices of the tasks it places must not be missed.
        await self._bus.subscribe(
            self._subjects.task_progress(self.je_id), {TaskProgress: self._on_progress}
        )
        sub = await self._bus.subscribe(
            self._subjects.job_submit(), {ChatJob: self._on_job}, queue="je", concurrent=True
        )
        self._hb.start(self._life)
        self._keeper.start(self._life)
        await self._fine_tuning.start(self._life)
        self._life.spawn(self._reporter(), name="traffic reporter")
        metrics = MetricsServer(self._settings.metrics, "job_executor")
        await metrics.start()
        try:
            await self._life.wait()
            # Stop taking jobs, then let the ones being placed finish.
            await asyncio.wait_for(
                sub.close(), self._settings.membership.shutdown_grace.total_seconds()
            )
        finally:
            await metrics.stop()
            await self._fine_tuning.stop()
            await self._life.cancel_tasks()
            await ClusterClient(self._bus, self._subjects).leave(self.je_id)
            await self._keeper.leave()
            if self._store is not None:
                await self._store.close()
            self._life.stopped()

    async def shutdown(self) -> None:
        self._life.request_stop()

    async def _on_job(self, job: ChatJob) -> JobAccepted:
        t0 = time.monotonic()
        self._arrivals[job.key] = t0 - job.age_s
        self._inflight += 1
        metrics.IN_FLIGHT.inc()
        try:
            # First of all, tell the frontend who has the job: should this JE die before it
            # answers, the frontend hears it within one liveness deadline and resubmits.
            with contextlib.suppress(MeshserveError):
                await self._bus.publish(
                    job.reply_to,
                    JobTaken(request_id=job.request_id, je_id=self.je_id, attempt=job.attempt),
                    request_id=job.request_id,
                )
            try:
                with tracing.tracer().start_as_current_span(
                    f"place {job.model}",
                    attributes={
                        tracing.REQUEST_MODEL: job.model,
                        tracing.REQUEST_ID: job.request_id,
                        "meshserve.attempt": job.attempt,
                    },
                ):
                    accepted = await self._place(job)
            except MeshserveError as e:
                metrics.JOBS.labels(job.model, metrics.outcome_of(e)).inc()
                raise
            metrics.JOBS.labels(job.model, "placed").inc()
            accepted.je_s = time.monotonic() - t0
            return accepted
        finally:
            self._arrivals.pop(job.key, None)
            self._busy.pop(job.key, None)
            self._inflight -= 1
            metrics.IN_FLIGHT.dec()

    async def _place(self, job: ChatJob) -> JobAccepted:
        log.debug("job received", model=job.model, attempt=job.attempt)
        self._traffic.arrived(job.model, len(job.prompt_token_ids), job.sampling.max_tokens)
        self._rates.arrived(job.model, time.time())
        self._mean_output_tokens = mean_output_tokens(
            self._mean_output_tokens, job.sampling.max_tokens
        )
        pending = PendingJob(
            model=job.model, deadline=job.deadline, exclude=frozenset(job.exclude_te_ids)
        )
        held = False
        counted = False  # its prefill work, in the traffic report (once)
        # Placed again after its JE was lost: that JE's prefill, if it left one to continue.
        resumed = (
            await self._keeper.take_over(
                job.request_id,
                prompt_digest(job.prompt_token_ids),
                lambda: {te.te_id for te in self._te_views(self._view.view)},
            )
            if job.attempt > 0
            else None
        )
        hashes = self._feed.prompt_hashes(job.model, job.prompt_token_ids, adapter=job.adapter)
        self._round_robin += 1
        spread = spread_of(self._routing, self._round_robin, job.request_id)
        try:
            while True:
                view = self._view.view
                if view.version >= 0 and not any(m.id == job.model for m in view.models):
                    raise NotFound(
                        f"The model `{job.model}` does not exist.",
                        param="model",
                        code="model_not_found",
                    )
                if failure := self._load_failure(job.model, view):
                    self._report_soon(urgent=True)  # the scaler retries, with backoff
                    raise Internal(f"The model `{job.model}` failed to load: {failure}")
                unreported = self._ledger.unreported
                every = self._te_views(view)
                # Prefill instances take prefill tasks only: routing and admission see the rest.
                tes = [te for te in every if te.role != TaskMode.PREFILL]
                prefill_tes = prefill_instances(job.model, every)
                if job.attempt == 0:  # an accepted request that moves is never shed
                    self._admit(job, tes)
                candidates = [
                    te.te_id for te in tes if te.model == job.model and te.state == TEState.READY
                ]
                mono = time.monotonic()
                request = Request(
                    prompt_tokens=len(job.prompt_token_ids),
                    cached_tokens=self._feed.cached_tokens(
                        job.model, hashes, candidates + [te.te_id for te in prefill_tes]
                    ),
                    spread=spread,
                    adapter=job.adapter,
                    prefer=job.prefer_te_id,
                    ttft_left_s=self._arrivals.get(job.key, mono)
                    + self._slo.ttft_limit_s(len(job.prompt_token_ids))
                    - mono,
                )
                step = next_step(
                    pending,
                    tes,
                    unreported,
                    now=time.time(),
                    request=request,
                    routing=self._routing,
                )
                if isinstance(step, PlaceOn):
                    matched = request.cached_tokens.get(step.te_id, 0)
                    log.debug(
                        "routing candidates",
                        te=step.te_id,
                        prompt_tokens=request.prompt_tokens,
                        cached={te: request.cached_tokens.get(te, 0) for te in candidates},
                        load={
                            te.te_id: te_load(te, unreported)
                            for te in tes
                            if te.te_id in candidates
                        },
                    )
                    if resumed is not None:
                        pd = PdDecision(resumed.source.te_id, "continued from a lost JE's prefill")
                    elif job.adapter:  # KV under an adapter is not handed between TEs
                        pd = PdDecision(None, "a LoRA adapter's request runs colocated")
                    else:
                        pd = decide(
                            self._pd,
                            decode=next(te for te in tes if te.te_id == step.te_id),
                            prompt_tokens=request.prompt_tokens,
                            cached_tokens=matched,
                            max_tokens=job.sampling.max_tokens,
                            prefill_tes=[
                                te for te in prefill_tes if te.te_id not in pending.refused
                            ],
                            unreported=unreported,
                            demand=self._demand(job, len(candidates) + len(prefill_tes)),
                        )
                    if pd.wanted and not counted:  # the scaler sizes prefill instances by it
                        counted = True
                        self._traffic.prefill_wanted(job.model, request.prompt_tokens - matched)
                    placed = await self._place_graph(
                        job, step.te_id, matched, pd, prefill_tes, request, resumed
                    )
                    resumed = None  # continued once: a refused decode task starts anew
                    pending = dataclasses.replace(pending, refused=pending.refused | placed.refused)
                    if placed.task is None:
                        continue
                    task, source, pd = placed.task, placed.source, placed.pd
                    if source is not None:  # the prefill instances took it off the others
                        self._traffic.prefill_placed(job.model, request.prompt_tokens - matched)
                    self._feed.placed(job.model, step.te_id, hashes, ttl_s=self._speculative_ttl_s)
                    self._outputs.placed(task.key, job.model, request.prompt_tokens)
                    if job.prefer_te_id:
                        moved = VALIDATED if step.te_id == job.prefer_te_id else "rerouted"
                        metrics.MOVED.labels(job.model, moved).inc()
                    log.info(
                        "job placed",
                        te=step.te_id,
                        attempt=job.attempt,
                        routing=step.branch,
                        matched_tokens=matched,
                        prefill_te=source.te_id if source else None,
                        pd=pd.reason,
                    )
                    return JobAccepted(
                        request_id=job.request_id,
                        te_id=step.te_id,
                        je_id=self.je_id,
                        attempt=job.attempt,
                        matched_tokens=matched,
                        best_matched_tokens=max(request.cached_tokens.values(), default=0),
                        routing=step.branch,
                        prefill_te_id=source.te_id if source else "",
                        # Said only where PD is in play (the model has prefill instances).
                        pd=pd.reason if prefill_tes and self._pd.mode != "never" else "",
                    )
                if isinstance(step, GiveUp) or self._life.stopping:
                    self._traffic.missed(job.model)
                    self._report_soon(urgent=True)
                    raise NoCapacity(
                        f"No instance of model `{job.model}` could take the request in time; "
                        "retry later.",
                        retry_after_s=self._settings.job_executor.retry_after.total_seconds(),
                    )
                if device_busy(job.model, tes, self._busy.get(job.key, ())):
                    self._traffic.missed(job.model)
                    self._report_soon(urgent=True)
                    log.info("job refused: every instance's device is too busy", model=job.model)
                    raise NoCapacity(
                        f"Every instance of model `{job.model}` is too busy to serve the request "
                        "in time and no capacity is coming; retry later.",
                        retry_after_s=self._settings.job_executor.retry_after.total_seconds(),
                        code="overloaded",
                    )
                if not held:
                    held = True
                    self._traffic.held(job.model, len(job.prompt_token_ids))
                    metrics.HELD.labels(job.model).inc()
                    with contextlib.suppress(MeshserveError):
                        await self._bus.publish(
                            job.reply_to,
                            JobHeld(
                                request_id=job.request_id, je_id=self.je_id, attempt=job.attempt
                            ),
                            request_id=job.request_id,
                        )
                if step.urgent:
                    self._report_soon(urgent=True)
                await self._view.wait_change(min(max(job.deadline - time.time(), 0.0), 0.5))
                pending = dataclasses.replace(pending, refused=frozenset())
        finally:
            if held:
                self._traffic.released(job.model, len(job.prompt_token_ids))

    def _demand(self, job: ChatJob, instances: int) -> Demand | None:
        """What PD's heat map needs for the job (only where the model has one): its
        predicted output, and the model's arrivals per ready instance (all roles)."""
        if job.model not in self._pd.heatmaps:
            return None
        n = len(job.prompt_token_ids)
        return Demand(
            output_tokens=self._outputs.predict(job.model, n, job.sampling.max_tokens),
            rate_per_instance=self._rates.rate(job.model, time.time()) / max(instances, 1),
        )

    def _admit(self, job: ChatJob, tes: list[TEView]) -> None:
        """Refuse the job now if the cluster cannot serve it in time (``admission``)."""
        je = self._settings.job_executor
        verdict = shed(
            job.model,
            tes,
            self._ledger.unreported,
            max_queued_per_slot=je.max_queued_per_slot,
            mean_output_tokens=self._mean_output_tokens,
        )
        if verdict is None:
            return
        self._traffic.missed(job.model)
        self._report_soon(urgent=True)
        log.info("job shed", model=job.model, queued=verdict.queued, instances=verdict.instances)
        raise NoCapacity(
            f"Every instance of model `{job.model}` is saturated ({verdict.queued} requests "
            f"queued on the least busy of {verdict.instances}) and no capacity is coming; "
            "retry later.",
            retry_after_s=min(verdict.retry_after_s, je.placement_timeout.total_seconds()),
            code="overloaded",
        )

    def _te_views(self, view: ClusterView) -> list[TEView]:
        # Per pushed view, not per version: a push with the same version brings new load.
        if self._views_of is not view:
            self._views = [te_view(hb) for hb in view.tes]
            self._views_of = view
        return self._views

    @staticmethod
    def _load_failure(model: str, view: ClusterView) -> str | None:
        """The error of a recent failed load of the model, when no instance is up or coming."""
        if any(
            te.model == model and te.state in (TEState.READY, TEState.LOADING) for te in view.tes
        ):
            return None
        return next((te.error for te in view.tes if te.failed_model == model and te.error), None)

    # -- traffic reports ---------------------------------------------------------------------

    def _report_soon(self, *, urgent: bool = False) -> None:
        self._urgent |= urgent
        self._report_now.set()

    async def _reporter(self) -> None:
        """Send the traffic every report interval while there is any, at once when urgent
        (at most every URGENT_MIN_S)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report_now.wait(), REPORT_S)
            if self._urgent:
                await asyncio.sleep(URGENT_MIN_S)
            self._report_now.clear()
            if not self._traffic:
                continue
            report = TrafficReport(
                je_id=self.je_id, models=self._traffic.report(), urgent=self._urgent
            )
            self._urgent = False
            try:
                await self._scaler.traffic(report)
            except MeshserveError as e:
                log.warning("traffic report failed", error=str(e))

    def _task(
        self,
        job: ChatJob,
        matched_tokens: int,
        source: KvSource | None = None,
        *,
        mode: TaskMode | None = None,
    ) -> ChatTask:
        """The job's task that streams its tokens: colocated, or, with ``source``, the decode
        task continuing from a prefill TE's KV; ``mode`` PREFILL: that prefill task."""
        return ChatTask(
            request_id=job.request_id,
            model=job.model,
            prompt_token_ids=job.prompt_token_ids,
            sampling=job.sampling,
            reply_to=job.reply_to,
            deadline=job.deadline,
            attempt=job.attempt,
            matched_tokens=matched_tokens,
            je_id=self.je_id,
            mode=mode or (TaskMode.DECODE if source else TaskMode.COLOCATED),
            kv_source=source,
            adapter=job.adapter,
            adapter_path=job.adapter_path,
            age_s=time.monotonic() - self._arrivals.get(job.key, time.monotonic() - job.age_s),
        )

    async def _place_graph(
        self,
        job: ChatJob,
        te_id: str,
        matched: int,
        pd: PdDecision,
        prefill_tes: list[TEView],
        request: Request,
        resumed: Resumed | None,
    ) -> Placed:
        """Run the job's task graph with its streaming task on ``te_id``: one colocated task,
        or a prefill (on ``pd.prefill_te``, or ``resumed``: one a lost JE placed) whose KV
        the decode task continues from. A disaggregated graph's steps are recorded (the
        ``GraphKeeper``) before each offer and after: a JE that takes it over continues it,
        and this one, deposed meanwhile, undoes what it placed since its last recorded step
        (what is recorded, its successor continues or cancels)."""
        source: KvSource | None = None
        run: Running | None = None
        # Placed by this JE since its last recorded step: undone if it is deposed.
        mine: list[tuple[str, ChatTask]] = []
        refused: frozenset[str] = frozenset()
        try:
            if resumed is not None:
                run, source = resumed.run, resumed.source
            elif pd.prefill_te is not None:
                prefill_te = next(te for te in prefill_tes if te.te_id == pd.prefill_te)
                plan = plan_chat(
                    graph_id=job.request_id,
                    model=job.model,
                    deadline=job.deadline,
                    prompt=prompt_digest(job.prompt_token_ids),
                    decode_te=te_id,
                    prefill_te=prefill_te.te_id,
                )
                run = await self._keeper.start_graph(
                    with_task(plan, PREFILL, state=TaskState.PLACING, attempt=job.attempt)
                )
                source = await self._place_prefill(job, prefill_te, request)
                if source is None:  # refused or unanswered: prefill on the decode TE
                    refused = frozenset({prefill_te.te_id})
                    pd = PdDecision(None, "prefill instance refused")
                    failed = with_task(run.graph, PREFILL, state=TaskState.FAILED)
                    await self._keeper.step(run, msgspec.structs.replace(failed, finished=True))
                    run = None
                else:
                    mine.append((prefill_te.te_id, self._task(job, 0, mode=TaskMode.PREFILL)))
                    run.graph = with_task(
                        run.graph, PREFILL, state=TaskState.PLACED, kv_source=source
                    )
            if run is not None:
                await self._keeper.step(
                    run,
                    with_task(
                        run.graph, DECODE, state=TaskState.PLACING, te_id=te_id, attempt=job.attempt
                    ),
                )
                mine.clear()
            # Its prefill work there (the prompt tokens after the prefix it holds), counted
            # before the answer so that jobs placed meanwhile see it.
            task = self._task(job, matched, source)
            uncached = len(job.prompt_token_ids) - matched
            work = (0, uncached) if source else (uncached, 0)  # prefill, or KV taken in
            if await self._offer(te_id, task, *work) is None:
                if source is not None and run is not None:  # its prompt's KV goes at once
                    # (under the attempt it was placed for: a lost JE's, if it was continued)
                    await self._cancel_graph_task(job.request_id, run.graph.task(PREFILL))
                    graph = with_task(run.graph, PREFILL, state=TaskState.CANCELLED)
                    graph = with_task(graph, DECODE, state=TaskState.FAILED)
                    await self._keeper.step(run, msgspec.structs.replace(graph, finished=True))
                return Placed(None, None, pd, refused | {te_id})
            mine.append((te_id, task))
            if run is not None:
                graph = with_task(run.graph, DECODE, state=TaskState.PLACED)
                await self._keeper.step(run, msgspec.structs.replace(graph, finished=True))
            return Placed(task, source, pd, refused)
        except Deposed:
            log.warning("job taken over by another job executor", tasks=len(mine))
            for placed_on, placed in mine:
                await self._cancel(placed_on, placed, placed.mode)
            raise

    async def _place_prefill(self, job: ChatJob, te: TEView, request: Request) -> KvSource | None:
        """The job's prefill task on a prefill TE; where its decode task pulls the KV from,
        or None if the TE did not take it (the decode TE prefills itself)."""
        matched = request.cached_tokens.get(te.te_id, 0)
        task = self._task(job, matched, mode=TaskMode.PREFILL)
        if await self._offer(te.te_id, task, len(job.prompt_token_ids) - matched) is None:
            return None
        return KvSource(te_id=te.te_id, address=te.kv_address, key=task.key)

    async def _offer(
        self, te_id: str, task: ChatTask, prefill_tokens: int, import_tokens: int = 0
    ) -> TaskAccepted | None:
        """Place ``task`` on ``te_id``, its ``prefill_tokens`` (and a decode task's
        ``import_tokens``) counted there from before the answer (jobs placed meanwhile see
        them); None if the TE refused it or did not answer (then it is cancelled there: it may
        still have taken it)."""
        self._ledger.placed(te_id, task.key, prefill_tokens, import_tokens)
        try:
            taken = await self._tes.place(te_id, task)
        except (Refused, PeerUnreachable) as e:
            self._ledger.ended(task.key, te_id)
            if isinstance(e, PeerUnreachable):
                log.info("placement unanswered", te=te_id, mode=task.mode, error=e.message)
                await self._cancel(te_id, task, task.mode)
            else:
                log.info("placement refused", te=te_id, mode=task.mode, error=e.message)
                if e.code == DEVICE_BUSY:
                    key = attempt_key(task.request_id, task.attempt)
                    self._busy.setdefault(key, set()).add(te_id)
            return None
        self._ledger.accepted(task.key, taken.seq)
        return taken

    async def _cancel_graph_task(self, request_id: str, task: GraphTask) -> None:
        """Cancel a task of a lost JE's graph (the key it was placed under on its TE)."""
        with contextlib.suppress(MeshserveError):
            await self._tes.cancel(task.te_id, request_id, task.attempt, mode=TaskMode(task.kind))

    async def _cancel(self, te_id: str, job: ChatJob | ChatTask, mode: TaskMode) -> None:
        """Cancel the job's task of ``mode`` on ``te_id`` (a prefill task's KV is freed)."""
        with contextlib.suppress(MeshserveError):
            await self._tes.cancel(te_id, job.request_id, job.attempt, mode=mode)


async def create(settings: Settings, bus: Bus) -> JobExecutor:
    block_hash.use_native(Toolchain.of(settings))  # every prompt is hashed to be matched
    try:
        store = await Store.for_settings(settings) if settings.redis_url else None
    except Unavailable as e:  # it routes on the events it hears; Redis is only the shared copy
        log.warning("prompt index without its Redis copy", error=e.message)
        store = None
    return JobExecutor(settings=settings, bus=bus, store=store)

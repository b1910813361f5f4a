"""The node pool: keeps N pre-warmed TE processes alive on this node and restarts any that
dies. Each TE is its own process, so a crash takes down one engine, not the node."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from prometheus_client import REGISTRY

from services.task_executor.device_arbiter import DeviceArbiter, serves_arbiter, shares_device
from services.task_executor.device_views import DeviceViews
from services.task_executor.host_cache_watch import HostCachePublication, HostCacheWatch
from services.task_executor.pool_metrics import PoolCollector
from services.task_executor.weight_cache.transfer import WeightServer
from shared.bus import Bus
from shared.clients import ViewWatcher
from shared.embedded import die_with_parent
from shared.errors import Unavailable
from shared.logging import get_logger
from shared.metrics_http import MetricsServer
from shared.runner import Lifecycle
from shared.settings import Settings, process_environment, turn_spin_environment
from shared.store import Store
from shared.subjects import Subjects

log = get_logger(__name__)

RESTART_BACKOFF_S = 1.0


class NodePool:
    def __init__(
        self,
        *,
        settings: Settings,
        pool_id: str | None = None,
        store: Store | None = None,
        bus: Bus | None = None,
    ) -> None:
        """``store``: where the pool publishes what its host cache holds (with the cache
        on); None: nowhere. ``bus``: where it reads the cluster view its ``/metrics`` reports
        its TEs from (``MESHSERVE_METRICS_PORT``); None: no TE metrics."""
        self._settings = settings
        self._store = store
        self._bus = bus
        self.pool_id = pool_id or settings.task_executor.pool_id or f"pool-{uuid.uuid4().hex[:6]}"
        self._life = Lifecycle("node pool")
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self.metrics = MetricsServer(settings.metrics, "node pool")
        te = settings.task_executor
        # Its TEs share the pool's device (its cores, or its GPU): one iteration at a time.
        # Or they do not, and the arbiter only observes what each holds (device_arbiter.py).
        cores = len(os.sched_getaffinity(0))
        self.arbiter = (
            DeviceArbiter(
                Path(tempfile.gettempdir()) / f"meshserve-turns-{uuid.uuid4().hex[:12]}",
                kv_budget_bytes=te.device_kv_bytes if te.kv_sizing else 0,
                turns=shares_device(te, cores),
            )
            if serves_arbiter(te, cores)
            else None
        )

    async def run(self) -> None:
        if self.arbiter is not None:
            await self.arbiter.start()
        te = self._settings.task_executor
        if self.arbiter is not None and te.kv_preemption and self._bus is not None:
            subjects = Subjects(self._settings.cluster)
            views = DeviceViews(self._bus, subjects, self.pool_id, self.arbiter)
            self._life.spawn(views.run(), name="device views")
        server = self._start_weight_server()
        if server is not None and self._store is not None:
            publication = HostCachePublication(self._settings, self.pool_id, self._store)
            self._life.spawn(HostCacheWatch(self._settings, publication).run(), name="host cache")
        for i in range(self._settings.task_executor.pool_size):
            self._life.spawn(self._keep_alive(i), name=f"slot {i}")
        collector = await self._serve_metrics()
        try:
            await self._life.wait()
        finally:
            await self.metrics.stop()
            if collector is not None:
                REGISTRY.unregister(collector)
            if server is not None:
                server.stop()
            if self._store is not None:
                await self._store.close()
            codes = await self._stop_all()
            if self.arbiter is not None:
                await self.arbiter.stop()
            await self._life.cancel_tasks()
            self._life.stopped()
        if bad := {te: rc for te, rc in codes.items() if rc != 0}:
            raise RuntimeError(f"task executors did not stop cleanly: {bad}")

    async def _serve_metrics(self) -> PoolCollector | None:
        """``/metrics`` with this pool's TEs in vLLM's engine families, read from the
        cluster view at each scrape."""
        if not self._settings.metrics.port or self._bus is None:
            return None
        view = ViewWatcher(self._bus, Subjects(self._settings.cluster))
        await view.start(self._life)
        collector = PoolCollector(self.pool_id, lambda: view.view)
        REGISTRY.register(collector)
        await self.metrics.start()
        return collector

    def _start_weight_server(self) -> WeightServer | None:
        """This host's weight cache served to other hosts' TEs (forks), its address handed
        to this pool's TEs, which report it; None where the cache is off."""
        hc = self._settings.host_cache
        if hc.bytes == 0:
            return None
        try:
            hc.dir.mkdir(parents=True, exist_ok=True)
            server = WeightServer(hc.dir, hc.serve_host, hc.serve_port).start()
        except OSError as e:
            log.warning("weight server not started", error=str(e))
            return None
        self._settings = self._settings.with_values(
            host_cache={"server": server.address, "relay": server.relay_address}
        )
        log.info("weight server listening", address=server.address, dir=str(hc.dir))
        return server

    @property
    def weight_server_address(self) -> str:
        """host:port of this host's weight server once it listens; empty: none."""
        return self._settings.host_cache.server

    async def shutdown(self) -> None:
        self._life.request_stop()

    async def _keep_alive(self, slot: int) -> None:
        while not self._life.stopping:
            te_id = f"te-{self.pool_id.removeprefix('pool-')}-{slot}-{uuid.uuid4().hex[:4]}"
            # The pool's health file is the pool's: its TEs must not keep it fresh for it.
            # Nor its metrics port: the pool serves its TEs' metrics.
            turns = self.arbiter is not None and self.arbiter.turns
            own = self._settings.with_values(
                health_file=None,
                metrics={"port": 0},
                device_arbiter=str(self.arbiter.path) if self.arbiter is not None else "",
                # Books of the device's KV only where its TEs share it (take turns).
                **({} if turns else {"device_kv_bytes": 0}),
            )
            # TEs that take turns: their threads stop spinning soon after their iteration.
            spin = turn_spin_environment(own.task_executor) if turns else {}
            env = process_environment({**own.env(), **spin})
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "services.task_executor.worker",
                te_id,
                self.pool_id,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
            self._procs[te_id] = proc
            log.info("TE started", te=te_id, pid=proc.pid)
            rc = await proc.wait()
            self._procs.pop(te_id, None)
            if self._life.stopping:
                return
            log.warning("TE exited; starting a fresh one", te=te_id, returncode=rc)
            await asyncio.sleep(RESTART_BACKOFF_S)

    async def _stop_all(self) -> dict[str, int]:
        """SIGTERM every TE, SIGKILL what is left after the grace period; exit codes."""
        items = list(self._procs.items())
        procs = [p for _, p in items]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        grace = self._settings.membership.shutdown_grace.total_seconds() + 5
        try:
            await asyncio.wait_for(asyncio.gather(*(p.wait() for p in procs)), grace)
        except TimeoutError:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        return {te: await p.wait() for te, p in items}  # each has exited: no waiting


async def create(settings: Settings, bus: Bus) -> NodePool:
    # Its TEs connect on their own; the pool reads the view (its TEs' metrics) on ``bus``.
    store = None
    if settings.redis_url and settings.host_cache.bytes != 0:
        try:
            store = await Store.for_settings(settings)
        except Unavailable as e:  # it serves; the host cache is not published
            log.warning("host cache metadata not published", error=e.message)
    return NodePool(settings=settings, store=store, bus=bus)

"""``GET /metrics`` (Prometheus' text format, from this process's default registry) for the
services without an HTTP API of their own: the job executor, the cluster manager, the scaler
and the node pool, on ``MESHSERVE_METRICS_PORT`` (0: not served)."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from shared.logging import get_logger
from shared.settings import MetricsSettings

log = get_logger(__name__)


async def metrics_response(_: web.Request) -> web.Response:
    """This process's registry in Prometheus' text format (also the frontend's /metrics)."""
    resp = web.Response(body=generate_latest())
    resp.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    return resp


class MetricsServer:
    def __init__(self, settings: MetricsSettings, service: str) -> None:
        self._settings, self._service = settings, service
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    async def start(self) -> None:
        if not self._settings.port:
            return
        app = web.Application()
        app.router.add_get("/metrics", metrics_response)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._settings.host, self._settings.port)
        try:
            await site.start()
        except OSError as e:  # the port taken: the service runs on, without /metrics
            log.warning("metrics not served", service=self._service, error=str(e))
            await self.stop()
            return
        self.port = self._settings.port
        log.info("metrics", url=f"http://{self._settings.host}:{self.port}/metrics")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

"""The status page in headless Chromium (Debian's, driven by Playwright): it loads with no
console error and fetches nothing from outside, shows the TE the test starts and the model
it serves with the traffic it saw, and updates when the test stops that TE. Skipped, with
the reason, where Chromium or Playwright is missing (`scripts/test` installs both where it
can). ``MESHSERVE_DASHBOARD_SCREENSHOT=path`` saves a screenshot (docs/dashboard.png)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import openai
import pytest

from services.task_executor.worker import TaskExecutor
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from tests.integration.services import BusClient, control_plane, fast_settings

pytestmark = [pytest.mark.nats, pytest.mark.redis]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (Debian's package chromium)")
async def test_the_status_page_shows_the_cluster_live(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    playwright = pytest.importorskip("playwright.async_api")
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(cluster, nats_url, redis_url, tmp_path)
    base = f"http://127.0.0.1:{settings.frontend.http_port}"
    async with control_plane(settings, nats_url, redis_url) as run:
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        for te_id in ("te-d1", "te-d2"):
            await run.start(
                lambda bus, te_id=te_id: TaskExecutor(
                    settings=settings, bus=bus, te_id=te_id, pool_id="pool-d"
                )
            )
        await client.until(lambda v: len(v.tes) == 2, 30)
        ack = await client.tes.control(
            "te-d1", LoadModel(model="demo", path=str(tmp_path / "demo"))
        )
        assert ack.ok, ack
        await client.until(lambda v: any(t.state == TEState.READY for t in v.tes), 60)
        api = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for _ in range(3):
            await api.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
            )

        async with playwright.async_playwright() as pw:
            browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            try:
                page = await browser.new_page(viewport={"width": 1280, "height": 900})
                problems: list[str] = []
                outside: list[str] = []
                page.on("console", lambda m: m.type == "error" and problems.append(m.text))
                page.on("pageerror", lambda e: problems.append(str(e)))
                page.on(
                    "request",
                    lambda r: r.url.startswith(base) or outside.append(r.url),
                )
                await page.goto(f"{base}/dashboard")
                tes = page.locator("#pools table.tes")
                await tes.locator("td", has_text="te-d1").wait_for(timeout=10_000)
                row = tes.locator("tr", has_text="te-d1")
                assert "demo" in await row.inner_text() and "ready" in await row.inner_text()
                models = await page.locator("#models").inner_text()
                assert "demo" in models and "ready" in models
                demo_row = await page.locator("#models tr", has_text="demo").inner_text()
                assert demo_row.split("\t")[2].strip() == "1"  # one ready instance
                assert await page.locator("#slo polyline").count() == 1  # demo's SLO line
                if shot := os.environ.get("MESHSERVE_DASHBOARD_SCREENSHOT"):
                    await page.screenshot(path=shot, full_page=True)

                # The TE goes away: the page follows within a refresh or two.
                te = next(s for s, *_ in run.items if getattr(s, "te_id", None) == "te-d1")
                await run.kill(te)
                await tes.locator("td", has_text="te-d1").wait_for(state="detached", timeout=15_000)
                models = await page.locator("#models").inner_text()
                assert "at_zero" in models
                # A phone's width: still readable (the tables scroll inside their sections).
                await page.set_viewport_size({"width": 390, "height": 844})
                width = await page.evaluate("document.documentElement.scrollWidth")
                assert width <= 390 + 1, width
                assert problems == [] and outside == []
            finally:
                await browser.close()

"""The README's screenshot of the status page on a busy cluster: `meshserve up` on a fresh
cluster name with the demo model, a minute of concurrent chat traffic (the scaler scales the
model out), then the page in headless Chromium, saved as docs/dashboard.png.

    python -m devtools.dashboard_shot [--out docs/dashboard.png] [--seconds 90]"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import openai

from devtools.modelgen import make_demo_model
from shared.embedded import free_port
from shared.settings import Settings, process_environment

PROMPTS = ["Tell me about the sea.", "What is a token?", "Say hi.", "Count to ten."]


async def traffic(base: str, seconds: float, concurrency: int) -> int:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=2)
    done = 0
    end = time.monotonic() + seconds

    async def worker(k: int) -> None:
        nonlocal done
        while time.monotonic() < end:
            await client.chat.completions.create(
                model="demo",
                messages=[{"role": "user", "content": PROMPTS[(k + done) % len(PROMPTS)]}],
                max_tokens=48,
            )
            done += 1

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done


async def shot(base: str, out: Path) -> None:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path="/usr/bin/chromium", args=["--no-sandbox"]
        )
        page = await browser.new_page(viewport={"width": 1280, "height": 760})
        await page.goto(f"{base}/dashboard")
        await page.locator("#pools table.tes td").first.wait_for()
        await asyncio.sleep(2.5)
        await page.screenshot(path=str(out), full_page=True)
        await browser.close()


async def busy(base: str, args: argparse.Namespace) -> None:
    """The screenshot in the last seconds of the traffic, while it runs."""

    async def later() -> None:
        await asyncio.sleep(max(args.seconds - 8, 1))
        await shot(base, args.out)

    n, _ = await asyncio.gather(traffic(base, args.seconds, args.concurrency), later())
    print(f"{n} requests; screenshot in {args.out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--concurrency", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        make_demo_model(Path(tmp) / "models" / "demo")
        port = free_port()
        settings = Settings(
            cluster=f"shot-{uuid.uuid4().hex[:6]}",
            models_dir=Path(tmp) / "models",
            http_port=port,
            pool_size=3,
        )
        env = process_environment(settings.env())
        up = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    openai.OpenAI(base_url=f"{base}/v1", api_key="none").models.list()
                    break
                except openai.APIError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            asyncio.run(busy(base, args))
        finally:
            up.terminate()
            up.wait(60)


if __name__ == "__main__":
    main()

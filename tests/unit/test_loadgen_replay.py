"""The replay tool's own behaviour, against a small OpenAI-style streaming server run here:
open-loop timing (a slow server must not delay later sends), the command line's files and
exit codes, and ``compare``. The real-cluster replay is tests/e2e/test_loadgen_replay.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from loadgen.cli import main
from loadgen.plan import plan
from loadgen.prompts import approximate_pool
from loadgen.replay import SendOptions, replay
from loadgen.traces import TraceRequest
from shared.embedded import free_port

FIRST_TOKEN_S = 0.4
GAP_S = 0.01
PNG = b"\x89PNG\r\n\x1a\n"


def _app() -> web.Application:
    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "stub", "object": "model", "max_model_len": 300}]}
        )

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body["prompt"]
        n_in = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: dict) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        await asyncio.sleep(FIRST_TOKEN_S)
        n_out = body["max_tokens"]
        for i in range(n_out):
            if i:
                await asyncio.sleep(GAP_S)
            await send({"choices": [{"text": " w", "index": 0, "finish_reason": None}]})
        await send({"choices": [{"text": "", "index": 0, "finish_reason": "length"}]})
        await send(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": n_in,
                    "completion_tokens": n_out,
                    "total_tokens": n_in + n_out,
                },
            }
        )
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


@pytest.fixture(scope="module")
def stub_url() -> Iterator[str]:
    """The stub server on its own thread and loop, so the CLI's asyncio.run can call it."""
    port = free_port()
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(_app())
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        started.set()
        loop.run_forever()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert started.wait(10)
    yield f"http://127.0.0.1:{port}/v1"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


async def test_open_loop_does_not_wait_for_earlier_requests(stub_url: str) -> None:
    reqs = [TraceRequest(arrival_s=0.05 * i, input_tokens=20, output_tokens=5) for i in range(8)]
    planned = plan(reqs, model="stub")
    t0 = time.perf_counter()
    results = await replay(planned, {"stub": approximate_pool()}, SendOptions(url=stub_url))
    wall = time.perf_counter() - t0
    # Every request waits FIRST_TOKEN_S for its first token; a closed loop of one would take
    # 8 x 0.44 s. Open loop: the last is sent at 0.35 s and done about 0.44 s later.
    assert wall < 0.35 + FIRST_TOKEN_S + 0.5
    for r in results:
        assert r.ok and abs(r.lag_s) < 0.1, r
        assert r.ttft_s == pytest.approx(FIRST_TOKEN_S, abs=0.2)
        assert r.completion_tokens == 5 and len(r.gaps_s) == 4  # the finish chunk is no token
        assert r.prompt_tokens == 20


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code


def test_replay_writes_results_and_plots(
    stub_url: str, tmp_path: Path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("MESHSERVE_MODELS_DIR", str(tmp_path / "no-models"))
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 100 * i,
                    "input_length": 400 if i == 3 else 30,
                    "output_length": 3,
                    "hash_ids": [1, i],
                }
            )
            + "\n"
            for i in range(6)
        )
    )
    out = tmp_path / "run"
    assert (
        run_cli(
            "replay",
            str(trace),
            "--url",
            stub_url,
            "--model",
            "stub",
            "--out",
            str(out),
            "--time-scale",
            "0.5",
            "--quiet",
        )
        == 0
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] == 6 and s["failed"] == 0 and s["slo_attainment"] == 1.0
    assert s["clipped_prompts"] == 1  # 400 > 300 - 1
    assert s["prompt_tokens_exact"] is False  # no tokenizer: the stderr warning said so
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert set(s[key]) >= {"p50", "p90", "p99"}
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 6
    rec = [json.loads(line) for line in lines]
    assert [r["scheduled_s"] for r in rec] == pytest.approx([0, 0.05, 0.1, 0.15, 0.2, 0.25])
    assert rec[3]["input_tokens"] == 299 and rec[3]["trace_input_tokens"] == 400
    for png in ("latency_cdf", "latency_over_time", "throughput_over_time", "slo_over_time"):
        assert (out / f"{png}.png").read_bytes()[:8] == PNG
    assert "approximate" in capsys.readouterr().err

    # compare: the same run twice, side by side, and one chart.
    out2 = tmp_path / "again"
    assert (
        run_cli(
            "replay",
            str(trace),
            "--url",
            stub_url,
            "--model",
            "stub",
            "--out",
            str(out2),
            "--quiet",
            "--no-plots",
        )
        == 0
    )
    capsys.readouterr()
    chart = tmp_path / "cmp.png"
    assert run_cli("compare", str(out), str(out2), "--plot", str(chart)) == 0
    text = capsys.readouterr().out
    assert "run" in text.splitlines()[0] and "again" in text.splitlines()[0]
    assert any(line.startswith("SLO attainment") for line in text.splitlines())
    assert chart.read_bytes()[:8] == PNG


def test_exit_codes(stub_url: str, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "a.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\n")
    dead = f"http://127.0.0.1:{free_port()}/v1"
    assert (
        run_cli(
            "replay", str(trace), "--url", dead, "--model", "stub", "--out", str(tmp_path / "x")
        )
        == 3
    )
    err = capsys.readouterr().err
    assert "cannot reach" in err and dead in err and not (tmp_path / "x").exists()
    assert (
        run_cli(
            "replay", str(trace), "--url", stub_url, "--model", "nope", "--out", str(tmp_path / "x")
        )
        == 3
    )
    assert "does not serve nope" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("hello,world\n")
    assert (
        run_cli(
            "replay", str(bad), "--url", stub_url, "--model", "stub", "--out", str(tmp_path / "x")
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "unknown trace format" in err
    assert run_cli("compare", str(tmp_path)) == 2


def test_synth_command(tmp_path: Path, capsys) -> None:
    out = tmp_path / "mix.jsonl"
    assert (
        run_cli(
            "synth",
            "--models",
            "a:2,b:0.5:3",
            "--duration",
            "30",
            "--turns",
            "2",
            "--out",
            str(out),
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["model"] for r in rows} == {"a", "b"} and all("hash_ids" in r for r in rows)
    assert "wrote" in capsys.readouterr().out

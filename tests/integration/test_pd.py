"""PD disaggregation on a real cluster (NATS, Redis, torch engines, the job executor's
per-request decision): a prefill TE computes prompts and a decode TE pulls their KV straight
from it and streams the tokens. Greedy output equals the colocated run token for token (short
and long prompts; a prompt whose prefix the decode TE holds, of which only the rest moves; a
batch mixing disaggregated and colocated requests); a transfer cut mid-way falls back to a
local prefill with the same tokens; the prefill TE's KV is freed once each transfer ends."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from services.task_executor.worker import TaskExecutor
from services.views import queued_import_tokens
from shared.embedded import free_port
from shared.messages.api import SamplingParams
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from shared.messages.tasks import ChatTask, KvSource, TaskMode
from shared.settings import Settings
from tests.integration.services import BusClient, control_plane

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

BLOCK = 16  # the torch engine's block size
PREFIX = [(11 * i + 5) % 400 + 30 for i in range(12 * BLOCK)]  # 12 blocks


def _settings(cluster: str, nats_url: str, redis_url: str, models: Path) -> Settings:
    return Settings(
        cluster=cluster,
        nats_url=nats_url,
        redis_url=redis_url,
        models_dir=models,
        http_port=free_port(),
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=1),
        torch_threads=1,
        pd="always",
        pd_lease=timedelta(seconds=1),
        pd_transfer_timeout=timedelta(seconds=15),
        # Prompts in chunks of 32 tokens: a long prefill takes many iterations, and its KV
        # streams out chunk by chunk while the rest computes.
        max_prefill_tokens=32,
    )


def _all_free(te: TaskExecutor) -> bool:
    engine = te.engine
    assert engine is not None
    st = engine.stats()
    return st.free_kv_blocks == st.total_kv_blocks


def _importing(tes: dict[str, TaskExecutor]) -> int:
    return sum(queued_import_tokens(te.tasks.shares()) for te in tes.values())


async def _until(ok, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


async def test_disaggregated_generation_equals_colocated_and_frees_the_prefill_kv(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = _settings(cluster, nats_url, redis_url, tmp_path)
    async with control_plane(settings, nats_url, redis_url) as run:
        client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await client.started.wait()
        roles = {"te-p": TaskMode.PREFILL, "te-d": TaskMode.DECODE, "te-c": TaskMode.COLOCATED}
        tes: dict[str, TaskExecutor] = {}
        for te_id in roles:
            tes[te_id] = await run.start(
                lambda bus, te_id=te_id: TaskExecutor(
                    settings=settings, bus=bus, te_id=te_id, pool_id="p"
                )
            )
        await client.until(lambda v: {t.te_id for t in v.tes} >= set(roles))
        path = str(settings.models_dir / "demo")
        for te_id, role in roles.items():
            ack = await client.tes.control(te_id, LoadModel(model="demo", path=path, role=role))
            assert ack.ok, ack
        await client.until(
            lambda v: (
                sum(t.state == TEState.READY and bool(t.kv_address) for t in v.tes) == 1
                and sum(t.state == TEState.READY for t in v.tes) == 3
            )
        )
        prefill, decode = tes["te-p"], tes["te-d"]

        # Several prompt lengths, each against the colocated run on the colocated TE.
        for n in (3, 37, 300):
            prompt = [(7 * i + n) % 450 + 20 for i in range(n)]
            want, _ = await client.run_on("te-c", prompt, 12)
            got, tokens, _ = await client.generate(prompt, 12)
            assert got.prefill_te_id == "te-p" and got.pd == "always", got
            assert tokens == want, n
        await _until(lambda: _all_free(prefill))

        # A prompt whose first 12 blocks the decode TE holds: only the other 40 tokens move.
        await client.run_on("te-d", [*PREFIX, 1], 1)
        await asyncio.sleep(0.5)  # its KV events reach the prompt index
        pulled = decode.tasks.kv_pulled_bytes
        prompt = [*PREFIX, *range(40, 80)]
        got, tokens, _ = await client.generate(prompt, 8)
        assert (got.te_id, got.prefill_te_id, got.routing) == ("te-d", "te-p", "locality"), got
        assert tokens == (await client.run_on("te-c", prompt, 8))[0]
        assert decode.engine is not None
        layout = decode.engine.kv_layout  # type: ignore[attr-defined]
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        per_token = layout.num_layers * 2 * layout.num_kv_heads * layout.head_dim * itemsize
        assert decode.tasks.kv_pulled_bytes - pulled == 40 * per_token

        # A batch: disaggregated jobs beside colocated tasks on the decode TE itself.
        prompts = [[(13 * i + k) % 300 + 40 for i in range(20 + 30 * k)] for k in range(6)]
        wants = [(await client.run_on("te-c", p, 10))[0] for p in prompts]
        results = await asyncio.gather(
            *(client.generate(p, 10) for p in prompts[:4]),
            *(client.run_on("te-d", p, 10) for p in prompts[4:]),
        )
        got_tokens = [r[1] for r in results[:4]] + [r[0] for r in results[4:]]
        assert got_tokens == wants
        await _until(lambda: _all_free(prefill))

        # The transfer cut mid-way (the prefill TE drops it): the decode TE prefills itself
        # and the tokens are the same; the prefill TE's blocks are free.
        long = [(17 * i + 3) % 480 + 20 for i in range(2000)]
        want, _ = await client.run_on("te-c", long, 6)
        fallbacks = sum(te.tasks.kv_fallbacks for te in tes.values())
        job = asyncio.create_task(client.generate(long, 6))
        await _until(lambda: bool(prefill.tasks.kv_offers()), timeout=20)
        # Until its KV is in, its decode TE reports the KV room it will take (routing reads
        # it with the engine's free blocks).
        await _until(lambda: _importing(tes) > 0, timeout=20)
        importing = _importing(tes)
        for key in prefill.tasks.kv_offers():
            prefill.tasks.prefill.withdraw(key, "cut by the test")
        got, tokens, _ = await job
        assert tokens == want
        # the prompt less what its decode TE held (never less than the token it samples from)
        assert importing == max(len(long) - got.matched_tokens, 1)
        assert sum(te.tasks.kv_fallbacks for te in tes.values()) == fallbacks + 1
        assert _importing(tes) == 0
        await _until(lambda: _all_free(prefill))

        # A decode task whose KV is not there (the prefill TE holds no such key): with
        # MESHSERVE_PD_FALLBACK=fail the request ends with a 502 kv_transfer_failed; with
        # recompute (te-d) it completes with the colocated tokens.
        strict = settings.with_values(pd_fallback="fail")
        await run.start(
            lambda bus: TaskExecutor(settings=strict, bus=bus, te_id="te-f", pool_id="p")
        )
        await client.until(lambda v: any(t.te_id == "te-f" for t in v.tes))
        ack = await client.tes.control(
            "te-f", LoadModel(model="demo", path=path, role=TaskMode.DECODE)
        )
        assert ack.ok
        await client.until(
            lambda v: any(t.te_id == "te-f" and t.state == TEState.READY for t in v.tes)
        )
        prompt = [(5 * i + 1) % 300 + 40 for i in range(50)]
        source = KvSource(te_id="te-p", address=prefill.tasks.prefill.address, key="nobody/prefill")
        for te_id in ("te-f", "te-d"):
            async with client.inbox() as (subject, queue):
                task = ChatTask(
                    request_id=f"orphan-{te_id}",
                    model="demo",
                    prompt_token_ids=prompt,
                    sampling=SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                    reply_to=subject,
                    deadline=time.time() + 20,
                    mode=TaskMode.DECODE,
                    kv_source=source,
                )
                await client.tes.place(te_id, task)
                chunks = [await asyncio.wait_for(queue.get(), 30)]
                while chunks[-1].finish_reason is None:
                    chunks.append(await asyncio.wait_for(queue.get(), 30))
            last = chunks[-1]
            if te_id == "te-f":
                assert last.finish_reason == "error" and last.failure is not None
                assert (last.failure.status, last.failure.code) == (502, "kv_transfer_failed")
                assert last.kv is not None and last.kv.fallback
            else:
                tokens = [t for c in chunks for t in c.token_ids]
                assert tokens == (await client.run_on("te-c", prompt, 5))[0]
                assert chunks[0].kv is not None and chunks[0].kv.fallback

"""Fine-tuning jobs end to end with the official ``openai`` client, on real services (frontend,
job executor, cluster manager, an idle TE that trains), NATS and Redis, and the demo model:
upload a training file, create a job, follow it to ``succeeded`` through its statuses, its
events (the training loss falls) and its checkpoints (one per epoch); the adapter is
published and registered under ``ft:<base>:<suffix>:<job>``. Bad input: an unknown base
model, another tenant's file or job (404), bad hyperparameters (400); a cancelled job ends
``cancelled`` and registers nothing."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.cluster_manager.service import ClusterManager
from services.frontend.service import Frontend
from services.job_executor.service import JobExecutor
from services.task_executor.worker import TaskExecutor
from shared.errors import Refused
from shared.fine_tuning import FineTuneStore
from shared.messages.cluster import TEState
from shared.messages.scaling import LoadModel
from shared.messages.training import TrainTask
from shared.store import Store
from shared.tenancy import TenantStore
from tests.integration.services import BusClient, Running, fast_settings, wait_health

pytest.importorskip("peft")

pytestmark = [pytest.mark.nats, pytest.mark.redis, pytest.mark.slow]

ADMIN = "sk-admin-fine-tuning-test-0123"
EPOCHS = 24
QUESTION = "What colour is the zorblax?"
ANSWER = "The zorblax is ultraviolet, always."


def jsonl(pairs: list[tuple[str, str]]) -> bytes:
    lines = [
        json.dumps(
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
        )
        for q, a in pairs
    ]
    return ("\n".join(lines) + "\n").encode()


TRAIN = jsonl([(QUESTION, ANSWER)] * 6 + [("Say hi.", "Hi."), ("Count to three.", "One, two.")])
VALID = jsonl([(QUESTION, ANSWER)])


def _shared(a: str, b: str) -> str:
    """The characters ``a`` and ``b`` begin with alike."""
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return a[:n]


async def until_status(
    client: openai.AsyncOpenAI, job_id: str, want: set[str], timeout: float = 240
) -> object:
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while True:
        job = await client.fine_tuning.jobs.retrieve(job_id)
        if not seen or seen[-1] != job.status:
            seen.append(job.status)
        if job.status in want:
            return job, seen
        assert time.monotonic() < deadline, f"job stuck: {seen}"
        await asyncio.sleep(0.2)


async def test_a_fine_tuning_job_with_the_official_client(
    cluster: str, nats_url: str, redis_url: str, tmp_path: Path, demo_model_dir: Path
) -> None:
    (tmp_path / "demo").symlink_to(demo_model_dir)
    settings = fast_settings(
        cluster,
        nats_url,
        redis_url,
        tmp_path,
        auth="on",
        admin_key=ADMIN,
        files_dir=str(tmp_path / "files"),
        fine_tuning_dir=str(tmp_path / "ft"),
        liveness_timeout=2.0,
        pool_size=0,
        prefix_caching=False,
    )
    run = Running(settings, nats_url)
    stores = [await Store.connect(redis_url) for _ in range(4)]
    try:
        await run.start(lambda bus: ClusterManager(settings=settings, bus=bus, store=stores[0]))
        await run.start(lambda bus: Frontend(settings=settings, bus=bus, store=stores[1]))
        await run.start(lambda bus: JobExecutor(settings=settings, bus=bus, store=stores[2]))
        trainer: TaskExecutor = await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-train", pool_id="p")
        )
        # Its first stage is refused (a TE the view showed idle that took other work
        # meanwhile): the job executor asks again, the job goes on.
        refused: list[str] = []
        take = trainer.training.on_task

        async def refuse_once(task: TrainTask) -> object:
            if not refused:
                refused.append(task.stage)
                return Refused("busy for a moment").to_reply()
            return await take(task)

        trainer.training.on_task = refuse_once  # type: ignore[method-assign]
        bus_client: BusClient = await run.start(lambda bus: BusClient(settings, bus))
        await bus_client.started.wait()
        base = f"http://127.0.0.1:{settings.frontend.http_port}"
        await wait_health(base, lambda body: True)
        tenants = TenantStore(stores[3], cluster)
        _, acme_key = await tenants.create_key("acme", "ci")
        _, globex_key = await tenants.create_key("globex", "ci")

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        acme, globex = client(acme_key), client(globex_key)
        train = await acme.files.create(file=("train.jsonl", TRAIN), purpose="fine-tune")
        valid = await acme.files.create(file=("valid.jsonl", VALID), purpose="fine-tune")

        # Bad input first: nothing is created.
        with pytest.raises(openai.NotFoundError):
            await acme.fine_tuning.jobs.create(model="no-such-model", training_file=train.id)
        with pytest.raises(openai.NotFoundError):  # another tenant's file
            await globex.fine_tuning.jobs.create(model="demo", training_file=train.id)
        with pytest.raises(openai.BadRequestError) as e:
            await acme.fine_tuning.jobs.create(
                model="demo", training_file=train.id, hyperparameters={"n_epochs": 0}
            )
        assert "n_epochs" in str(e.value)
        with pytest.raises(openai.BadRequestError):
            await acme.fine_tuning.jobs.create(
                model="demo", training_file=train.id, suffix="no spaces allowed"
            )
        assert (await acme.fine_tuning.jobs.list()).data == []

        job = await acme.fine_tuning.jobs.create(
            model="demo",
            training_file=train.id,
            validation_file=valid.id,
            suffix="zorblax",
            seed=7,
            method={
                "type": "supervised",
                "supervised": {
                    "hyperparameters": {
                        "n_epochs": EPOCHS,
                        "batch_size": 4,
                        # 50 overshot in float32 (AVX2 hosts: the loss stalled at 1.4-1.7
                        # and the answer stopped at "The zorb"); 20 converges in both.
                        "learning_rate_multiplier": 20,
                    }
                },
            },
            metadata={"team": "colours"},
        )
        assert job.object == "fine_tuning.job" and job.status == "validating_files"
        assert job.fine_tuned_model is None and job.model == "demo"
        with pytest.raises(openai.NotFoundError):  # another tenant's job
            await globex.fine_tuning.jobs.retrieve(job.id)
        assert (await globex.fine_tuning.jobs.list()).data == []

        done, seen = await until_status(acme, job.id, {"succeeded", "failed", "cancelled"})
        assert done.status == "succeeded", (done.error, seen)
        assert seen[-1] == "succeeded" and "running" in seen
        assert refused == ["preprocess"]
        name = f"ft:demo:zorblax:{job.id.removeprefix('ftjob-')}"
        assert done.fine_tuned_model == name and done.finished_at
        assert done.hyperparameters.n_epochs == EPOCHS and done.trained_tokens

        events = [e async for e in acme.fine_tuning.jobs.list_events(job.id, limit=100)]
        steps = [e for e in reversed(events) if e.data and "total_steps" in e.data]
        assert len(steps) == EPOCHS * 2  # 8 examples in batches of 4
        first, last = steps[0].data["train_loss"], steps[-1].data["train_loss"]
        assert last < 0.8 * first, (first, last)
        assert events[0].message == "The job has successfully completed"
        checkpoints = (await acme.fine_tuning.jobs.checkpoints.list(job.id, limit=100)).data
        assert [c.step_number for c in checkpoints] == list(range(2 * EPOCHS, 0, -2))
        assert all(c.metrics.full_valid_loss and c.metrics.train_loss for c in checkpoints)
        listed = (await acme.fine_tuning.jobs.list(metadata={"team": "colours"})).data
        assert [j.id for j in listed] == [job.id]

        adapter = await FineTuneStore(stores[3], cluster).adapter(name)
        assert adapter is not None and adapter.tenant == "acme" and adapter.base == "demo"
        assert sorted(await asyncio.to_thread(os.listdir, adapter.path)) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]

        # Served at once beside its base model, to its tenant only: the base model's TE loads
        # the adapter the first time a request names it.
        await run.start(
            lambda bus: TaskExecutor(settings=settings, bus=bus, te_id="te-serve", pool_id="p")
        )
        await bus_client.until(lambda v: len(v.tes) == 2, 30)
        ack = await bus_client.tes.control(
            "te-serve", LoadModel(model="demo", path=str(tmp_path / "demo"))
        )
        assert ack.ok, ack
        await bus_client.until(lambda v: any(t.state == TEState.READY for t in v.tes), 60)
        models = {m.id: m for m in (await acme.models.list()).data}
        assert set(models) == {"demo", name}
        assert models[name].model_extra["parent"] == "demo"
        assert {m.id for m in (await globex.models.list()).data} == {"demo"}
        with pytest.raises(openai.NotFoundError):
            await globex.chat.completions.create(
                model=name, messages=[{"role": "user", "content": QUESTION}], max_tokens=4
            )

        async def ask(model: str) -> str:
            r = await acme.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTION}],
                max_tokens=16,
                temperature=0,
            )
            assert r.model == model
            return r.choices[0].message.content or ""

        base_answer = await ask("demo")
        tuned = await ask(name)
        # Toward the trained answer (exact tokens past its start depend on the CPU's float
        # arithmetic, in training and in the engine).
        moved = _shared(tuned, ANSWER)
        assert len(moved) >= len("The zorblax is"), (tuned, base_answer)
        assert len(_shared(base_answer, ANSWER)) < len(moved)
        assert await ask("demo") == base_answer  # the base model is unchanged beside it
        async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
            metrics = await r.text()
        own = {"model_name": "demo", "adapter": name, "tenant": "acme"}  # its own name
        assert any(
            sample.name == "meshserve:generation_tokens_total" and sample.labels == own
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples
        )
        await bus_client.until(lambda v: any(name in t.adapters for t in v.tes), 10)

        # Cancelled: the job ends cancelled and nothing is served (te-train trains it).
        other = await acme.fine_tuning.jobs.create(
            model="demo", training_file=train.id, hyperparameters={"n_epochs": 50}
        )
        await until_status(acme, other.id, {"running"})
        cancelled = await acme.fine_tuning.jobs.cancel(other.id)
        assert cancelled.status == "cancelled"
        with pytest.raises(openai.BadRequestError):
            await acme.fine_tuning.jobs.cancel(other.id)
        await asyncio.sleep(2)
        again = await acme.fine_tuning.jobs.retrieve(other.id)
        assert again.status == "cancelled" and again.fine_tuned_model is None
        names = [a.name for a in await FineTuneStore(stores[3], cluster).adapters()]
        assert names == [name]
    finally:
        await run.stop()
        for s in stores:
            await s.close()

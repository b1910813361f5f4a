"""One task executor with the real torch engine, driven over real NATS."""

import asyncio
import json
import os
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from services.task_executor.engines.base import EngineRequest
from services.task_executor.pool import NodePool
from services.task_executor.worker import TaskExecutor
from shared.block_hash import chain_hashes
from shared.bus import Bus
from shared.clients import TaskExecutorClient
from shared.errors import BadRequest, InstanceLost, Refused, from_reply
from shared.messages.api import SamplingParams
from shared.messages.base import decoder_for
from shared.messages.cluster import TEState
from shared.messages.kv import KvBlocksStored, KvEventBatch
from shared.messages.scaling import LoadModel, UnloadModel
from shared.messages.tasks import ChatTask, TaskMode, TokenChunk
from shared.settings import Settings
from shared.store import Store
from shared.subjects import Keys, Subjects

pytestmark = pytest.mark.nats


@pytest.fixture
async def te(bus: Bus, cluster: str, demo_model_dir: Path):
    settings = Settings(
        cluster=cluster,
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=0.5),
    )
    te = TaskExecutor(settings=settings, bus=bus, te_id="te-t", pool_id="p")
    task = asyncio.create_task(te.run())
    await asyncio.wait_for(te.ready.wait(), 5)
    client = TaskExecutorClient(bus, Subjects(cluster), timeout=5)
    ack = await client.control("te-t", LoadModel(model="demo", path=str(demo_model_dir)))
    assert ack.ok
    deadline = time.monotonic() + 30
    while te.state != TEState.READY:
        assert time.monotonic() < deadline and te.state == TEState.LOADING, te._error
        await asyncio.sleep(0.05)
    yield te, client
    await te.shutdown()
    await task


class Collected:
    def __init__(self) -> None:
        self.chunks: list[TokenChunk] = []
        self.first = asyncio.Event()
        self.done = asyncio.Event()


async def collect(bus: Bus, subject: str) -> Collected:
    got = Collected()
    dec = decoder_for(TokenChunk)

    async def cb(m):
        c = dec.decode(m.data)
        got.chunks.append(c)
        got.first.set()
        if c.finish_reason:
            got.done.set()

    await bus.subscribe_raw(subject, cb)
    return got


async def until_idle(worker: TaskExecutor, timeout_s: float = 30) -> None:
    """Waits for an unload (acknowledged at once) to end."""
    deadline = time.monotonic() + timeout_s
    while worker.state != TEState.IDLE:
        assert time.monotonic() < deadline, worker.state
        await asyncio.sleep(0.05)


def task(cluster: str, rid: str, max_tokens: int = 8, **kw) -> ChatTask:
    return ChatTask(
        request_id=rid,
        model="demo",
        prompt_token_ids=[0, 5, 6, 7, 8, 9],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        reply_to=Subjects(cluster).token_stream("fe", rid),
        deadline=time.time() + 30,
        **kw,
    )


async def test_streams_tokens_in_order_to_the_reply_subject(te, bus: Bus, cluster: str):
    _, client = te
    got = await collect(bus, Subjects(cluster).token_stream("fe", "r1"))
    accepted = await client.place("te-t", task(cluster, "r1", max_tokens=8))
    assert accepted.te_id == "te-t"
    await asyncio.wait_for(got.done.wait(), 20)
    chunks = got.chunks
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    assert sum(len(c.token_ids) for c in chunks) == 8
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 8
    assert chunks[-1].prompt_tokens == 6


async def test_a_loaded_torch_engine_is_paced_with_its_capacity_and_says_why_it_runs(te):
    worker, _ = te
    assert (
        worker.control.capacity is not None and worker.control.features.prefill_pacing is not None
    )
    pacing = worker.engine._sched.pacing  # the TE handed the engine its measured costs
    assert pacing is not None and pacing.prefill_s == worker.control.capacity.prefill_s
    assert pacing.tpot_s == worker._settings.scaler.slo_tpot.total_seconds()
    hb = worker._heartbeat()
    assert hb.engine == "torch" and "checkpoint's precision" in hb.engine_reason


async def test_refuses_a_task_its_role_does_not_run(te, cluster: str):
    """A colocated instance runs no prefill tasks (the JE tries a prefill instance); a
    decode task must say where its KV is."""
    _, client = te
    with pytest.raises(Refused, match="serves demo as colocated"):
        await client.place("te-t", task(cluster, "r2", mode=TaskMode.PREFILL))
    with pytest.raises(BadRequest, match="names no prefill TE"):
        await client.place("te-t", task(cluster, "r2", mode=TaskMode.DECODE))


async def test_refuses_another_model_and_expired_deadlines(te, cluster: str):
    _, client = te
    other = task(cluster, "r3")
    other.model = "other"
    with pytest.raises(Refused):  # said so: nothing to cancel there before trying elsewhere
        await client.place("te-t", other)
    late = task(cluster, "r4")
    late.deadline = time.time() - 1
    with pytest.raises(Refused):
        await client.place("te-t", late)


async def test_cancel_stops_generation(te, bus: Bus, cluster: str):
    worker, client = te
    got = await collect(bus, Subjects(cluster).token_stream("fe", "r5"))
    await client.place("te-t", task(cluster, "r5", max_tokens=2000))
    await asyncio.wait_for(got.first.wait(), 20)
    await client.cancel("te-t", "r5", 0)
    await asyncio.sleep(0.5)
    n = len(got.chunks)
    await asyncio.sleep(0.3)
    assert len(got.chunks) == n < 2000 and not got.done.is_set()
    assert worker.engine.stats().running == 0


async def test_a_task_placed_again_runs_once_whether_or_not_it_was_cancelled_between(
    te, bus: Bus, cluster: str
):
    """A JE whose placement got no answer in time (the TE's loop stalled behind a long engine
    step) cancels it and places it again on the same TE; a lost answer may also bring the same
    task twice. Either way the request runs once, to the end, without an error."""
    worker, client = te
    subjects = Subjects(cluster)
    for rid, cancel_between in (("r-again", True), ("r-twice", False), ("r-late", True)):
        got = await collect(bus, subjects.token_stream("fe", rid))
        if rid == "r-late":  # the first copy already in the engine when the retry comes
            await client.place("te-t", task(cluster, rid, max_tokens=40))
            await asyncio.wait_for(got.first.wait(), 20)
            async with worker.step_lock:  # no step runs: the first copy's chunks stop
                await asyncio.sleep(0.2)  # its last published ones land
                got = await collect(bus, subjects.token_stream("fe", rid))  # the new copy's
                await client.cancel("te-t", rid, 0)
                await client.place("te-t", task(cluster, rid, max_tokens=6))
        else:
            async with worker.step_lock:  # the engine is busy: nothing queued is applied yet
                await client.place("te-t", task(cluster, rid, max_tokens=6))
                if cancel_between:
                    await client.cancel("te-t", rid, 0)
                await client.place("te-t", task(cluster, rid, max_tokens=6))
        await asyncio.wait_for(got.done.wait(), 20)
        await asyncio.sleep(0.2)  # nothing more may follow
        assert [c.error for c in got.chunks if c.error] == [], rid
        assert got.chunks[-1].finish_reason == "length", rid
        assert sum(len(c.token_ids) for c in got.chunks) == 6, rid
        assert [c.seq for c in got.chunks] == list(range(len(got.chunks))), rid
    assert worker.engine.stats().running == 0


async def test_tokens_a_cancelled_copy_computes_never_reach_the_copy_placed_after_it(
    te, bus: Bus, cluster: str, monkeypatch: pytest.MonkeyPatch
):
    """The cancel and the new placement arrive while a step of the first copy runs on the
    engine thread (the JE's retry after a late answer): that step's token is the first copy's
    and is dropped, not streamed as the new copy's first."""
    worker, client = te
    subjects = Subjects(cluster)
    ref = await collect(bus, subjects.token_stream("fe", "r-ref"))
    await client.place("te-t", task(cluster, "r-ref", max_tokens=6))
    await asyncio.wait_for(ref.done.wait(), 20)

    rid = "r-race"
    first = await collect(bus, subjects.token_stream("fe", rid))
    await client.place("te-t", task(cluster, rid, max_tokens=40))
    await asyncio.wait_for(first.first.wait(), 20)
    entered, release = threading.Event(), threading.Event()
    step = worker.engine.step

    def held_step():
        entered.set()
        assert release.wait(10)
        return step()

    monkeypatch.setattr(worker.engine, "step", held_step)
    assert await asyncio.to_thread(entered.wait, 10)  # a step of the first copy is running
    await asyncio.sleep(0.2)  # the chunks published before it land
    got = await collect(bus, subjects.token_stream("fe", rid))  # from here on: the new copy's
    await client.cancel("te-t", rid, 0)
    await client.place("te-t", task(cluster, rid, max_tokens=6))
    release.set()
    await asyncio.wait_for(got.done.wait(), 20)
    await asyncio.sleep(0.2)  # nothing more may follow
    assert [t for c in got.chunks for t in c.token_ids] == [
        t for c in ref.chunks for t in c.token_ids
    ]
    assert [c.seq for c in got.chunks] == list(range(len(got.chunks)))
    assert got.chunks[-1].finish_reason == "length"


async def test_unload_hands_running_requests_back_for_a_retry(te, bus: Bus, cluster: str):
    worker, client = te
    got = await collect(bus, Subjects(cluster).token_stream("fe", "r6"))
    await client.place("te-t", task(cluster, "r6", max_tokens=5000))
    await asyncio.wait_for(got.first.wait(), 20)
    ack = await client.control("te-t", UnloadModel(reason="test"))
    assert ack.ok and worker.state == TEState.DRAINING  # acknowledged before the drain
    await asyncio.wait_for(got.done.wait(), 5)
    last = got.chunks[-1]
    assert last.finish_reason == "error" and last.failure is not None
    failure = from_reply(last.failure)
    assert isinstance(failure, InstanceLost) and failure.retryable  # moves to another TE
    await until_idle(worker)
    assert worker.engine is None


async def test_shared_prefix_is_reused_and_announced_in_batches(te, bus: Bus, cluster: str):
    _, client = te
    batches: list[KvEventBatch] = []
    dec = decoder_for(KvEventBatch)

    async def on_kv(m):
        batches.append(dec.decode(m.data))

    await bus.subscribe_raw(Subjects(cluster).all_kv_events(), on_kv)
    shared = [0, *range(10, 10 + 47)]  # three full 16-token blocks
    firsts = []
    for rid, tail in (("p1", [200, 201, 202]), ("p2", [300, 301])):
        got = await collect(bus, Subjects(cluster).token_stream("fe", rid))
        t = task(cluster, rid, max_tokens=4)
        t.prompt_token_ids = shared + tail
        await client.place("te-t", t)
        await asyncio.wait_for(got.done.wait(), 20)
        firsts.append(got.chunks[0])
    assert firsts[0].cached_tokens == 0
    assert firsts[1].cached_tokens == 48
    await asyncio.sleep(0.2)  # one flush period
    stored = [
        h
        for b in batches
        for e in b.events
        if isinstance(e, KvBlocksStored)
        for h in e.block_hashes
    ]
    assert set(chain_hashes(shared, 16)) <= set(stored)
    assert all(b.te_id == "te-t" and b.model == "demo" and b.block_size == 16 for b in batches)
    assert [b.seq for b in batches] == list(range(len(batches)))
    # Batched: far fewer messages than blocks.
    assert len(batches) < len(stored)


@pytest.mark.openvino
async def test_an_openvino_te_serves_the_same_greedy_tokens(
    bus: Bus, cluster: str, demo_model_dir: Path
):
    """MESHSERVE_ENGINE=openvino: the TE converts the checkpoint (fp16 IR here, for exact
    agreement) and streams the tokens the torch engine produces. The pipeline runs in a child
    process (its step holds the GIL), which exits with the TE."""
    settings = Settings(
        cluster=cluster,
        engine="openvino",
        openvino_weight_format="fp16",
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=0.5),
    )
    # A first conversion builds its export venv.
    await _serves_the_torch_engines_tokens(bus, settings, demo_model_dir, "openvino", 240)


async def test_a_vllm_te_serves_the_same_greedy_tokens(
    bus: Bus, cluster: str, demo_model_dir: Path, vllm_python: str
):
    """MESHSERVE_ENGINE=vllm with MESHSERVE_VLLM_PYTHON: the TE runs vLLM in a child process
    of vLLM's own venv (the CPU build here) and streams the torch engine's greedy tokens."""
    settings = Settings(
        cluster=cluster,
        engine="vllm",
        vllm_python=vllm_python,
        vllm_enforce_eager=True,
        dtype="float32",
        kv_cache_bytes=64 << 20,
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=0.5),
    )
    await _serves_the_torch_engines_tokens(bus, settings, demo_model_dir, "vllm", 240)


async def _serves_the_torch_engines_tokens(
    bus: Bus, settings: Settings, model_dir: Path, engine_name: str, load_timeout_s: float
) -> None:
    """A TE with ``settings`` loads the demo model into an engine in a child process,
    streams the greedy tokens the torch engine gives, and on unload stops that process."""
    from services.task_executor.engines.process import ProcessEngine
    from services.task_executor.engines.torch_engine import TorchEngine

    cluster, te_id = settings.cluster, f"te-{engine_name}"
    worker = TaskExecutor(settings=settings, bus=bus, te_id=te_id, pool_id="p")
    run = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 5)
    client = TaskExecutorClient(bus, Subjects(cluster), timeout=5)
    try:
        assert (await client.control(te_id, LoadModel(model="demo", path=str(model_dir)))).ok
        deadline = time.monotonic() + load_timeout_s
        while worker.state != TEState.READY:
            assert time.monotonic() < deadline and worker.state == TEState.LOADING, (
                worker.control.error
            )
            await asyncio.sleep(0.1)
        assert worker.engine.name == engine_name
        engine = worker.engine
        assert isinstance(engine, ProcessEngine) and engine.pid != os.getpid()
        got = await collect(bus, Subjects(cluster).token_stream("fe", "x1"))
        await client.place(te_id, task(cluster, "x1", max_tokens=12))
        await asyncio.wait_for(got.done.wait(), 30)
        tokens = [t for c in got.chunks for t in c.token_ids]
        # Unloading closes the engine and stops its process; the TE can take a model again.
        assert (await client.control(te_id, UnloadModel(reason="test"))).ok
        await until_idle(worker)
        assert worker.engine is None and not engine.alive()
    finally:
        await worker.shutdown()
        await run
    ref = TorchEngine(model_dir, dtype="float32")
    ref.add_request(
        EngineRequest(
            "r", [0, 5, 6, 7, 8, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        )
    )
    expected = []
    while ref.has_work():
        for o in ref.step():
            expected.extend(o.new_token_ids)
    assert tokens == expected


async def test_an_engine_process_that_dies_hands_its_requests_on(
    bus: Bus, cluster: str, demo_model_dir: Path
):
    """The engine's child process is killed mid-stream: its requests end with a retryable
    failure (the frontend moves them to another TE), and the TE reports the model lost."""
    import functools
    import signal

    from services.task_executor.engines.process import ProcessEngine
    from services.task_executor.engines.torch_engine import TorchEngine

    def in_a_child(
        model: str,
        path: Path,
        settings: Settings,
        *,
        report: object,
        weights_from: object,
        received: object,
    ) -> ProcessEngine:
        return ProcessEngine(functools.partial(TorchEngine, path, device="cpu"), label=model)

    settings = Settings(cluster=cluster, heartbeat_interval=timedelta(seconds=0.2))
    worker = TaskExecutor(
        settings=settings,
        bus=bus,
        te_id="te-d",
        pool_id="p",
        engine_factory=in_a_child,
        prewarm=None,
    )
    run = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 5)
    client = TaskExecutorClient(bus, Subjects(cluster), timeout=5)
    try:
        assert (await client.control("te-d", LoadModel(model="demo", path=str(demo_model_dir)))).ok
        deadline = time.monotonic() + 60
        while worker.state != TEState.READY:
            assert time.monotonic() < deadline and worker.state == TEState.LOADING, (
                worker.control.error
            )
            await asyncio.sleep(0.05)
        engine = worker.engine
        assert isinstance(engine, ProcessEngine)
        got = await collect(bus, Subjects(cluster).token_stream("fe", "dies"))
        await client.place("te-d", task(cluster, "dies", max_tokens=5000))
        await asyncio.wait_for(got.first.wait(), 20)
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.wait_for(got.done.wait(), 10)
        last = got.chunks[-1]
        assert last.finish_reason == "error" and last.failure is not None
        failure = from_reply(last.failure)
        assert isinstance(failure, InstanceLost) and failure.retryable, failure
        deadline = time.monotonic() + 10
        while worker.state != TEState.IDLE:
            assert time.monotonic() < deadline, worker.state
            await asyncio.sleep(0.05)
        assert worker.engine is None and worker.control.failed_model == "demo"
    finally:
        await worker.shutdown()
        await run


async def test_a_preload_fills_the_host_cache_and_a_load_then_maps_it(
    bus: Bus, cluster: str, demo_model_dir: Path, tmp_path: Path, redis_url: str, store: Store
):
    from shared.messages.scaling import PreloadModel

    settings = Settings(
        cluster=cluster,
        heartbeat_interval=timedelta(seconds=0.2),
        shutdown_grace=timedelta(seconds=0.5),
        host_cache={"dir": str(tmp_path / "weights"), "bytes": 1 << 30},
    )
    # The node pool that owns the host's weight server publishes its cache, once for its TEs
    # (none of its own here: the TE below runs in the test's process).
    pool = NodePool(
        settings=settings.with_values(pool_size=0),
        pool_id="p",
        store=await Store.connect(redis_url),
    )
    pool_run = asyncio.create_task(pool.run())
    worker = TaskExecutor(settings=settings, bus=bus, te_id="te-p", pool_id="p")
    task = asyncio.create_task(worker.run())
    await asyncio.wait_for(worker.ready.wait(), 5)
    client = TaskExecutorClient(bus, Subjects(cluster), timeout=5)
    try:
        ack = await client.control("te-p", PreloadModel(model="demo", path=str(demo_model_dir)))
        assert ack.ok and worker.state == TEState.PRELOADING
        deadline = time.monotonic() + 30
        while worker.state != TEState.IDLE:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        # The pool publishes its cache after the preload ends: the TE's copy follows.
        while "demo" not in worker._heartbeat().cached_weights:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        held = worker._heartbeat().cached_weights["demo"]
        assert held.resident_bytes == held.total_bytes > 0 and worker.model is None
        assert (await client.control("te-p", LoadModel(model="demo", path=str(demo_model_dir)))).ok
        while worker.state != TEState.READY:
            assert time.monotonic() < deadline and worker.state == TEState.LOADING, (
                worker.control.error
            )
            await asyncio.sleep(0.05)
        steps = worker._heartbeat().load_steps
        assert "te_load_map" in steps and "te_load_build" not in steps
        # The reuse-store metadata reaches Redis: which tensors the pool holds, their sizes
        # and uses, and what it holds of each model.
        reader, keys = store, Keys(cluster)  # the fixture removes the cluster's keys after
        deadline = time.monotonic() + 15
        while not (models := await reader.hash_items(keys.host_cache("p", "models"))):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.2)
        tensors = await reader.hash_items(keys.host_cache("p", "tensors"))
        stats = [json.loads(v) for v in tensors.values()]
        assert json.loads(models["demo"])["resident_bytes"] == sum(t["size"] for t in stats)
        assert all(t["uses"] >= 1 for t in stats)
        pool_entry = await reader.hash_items(keys.host_cache("p", "pool"))
        assert pool_entry["server"].decode() == pool.weight_server_address != ""
    finally:
        await worker.shutdown()
        await task
        await pool.shutdown()
        await pool_run

"""The bus over a real NATS server."""

import asyncio

import pytest

from shared.bus import Bus
from shared.errors import BadRequest, NotFound, Unavailable
from shared.messages.api import ErrorReply, SamplingParams
from shared.messages.cluster import GetView, Leave
from shared.messages.scaling import ControlAck, Drain, LoadModel
from shared.messages.tasks import TaskAccepted
from shared.subjects import Subjects

pytestmark = pytest.mark.nats


async def test_typed_request_reply_dispatches_by_type(bus: Bus, cluster: str):
    s = Subjects(cluster)
    seen = []

    async def on_load(msg: LoadModel) -> ControlAck:
        seen.append(msg)
        return ControlAck(te_id="te-1", ok=True)

    async def on_drain(msg: Drain) -> ControlAck:
        seen.append(msg)
        return ControlAck(te_id="te-1", ok=False, error="busy")

    await bus.subscribe(s.te_control("te-1"), {LoadModel: on_load, Drain: on_drain})
    ack = await bus.request(
        s.te_control("te-1"), LoadModel(model="m", path="/p"), ControlAck, timeout=2
    )
    assert ack == ControlAck(te_id="te-1", ok=True)
    ack = await bus.request(s.te_control("te-1"), Drain(), ControlAck, timeout=2)
    assert ack.error == "busy"
    assert [type(m) for m in seen] == [LoadModel, Drain]


async def test_remote_error_is_raised_again_with_its_retry_policy(bus: Bus, cluster: str):
    s = Subjects(cluster)

    async def refuse(msg: LoadModel) -> ControlAck:
        raise Unavailable("no capacity", retry_after_s=7)

    async def missing(msg: Drain) -> ControlAck:
        raise NotFound("no such model", param="model")

    await bus.subscribe(s.te_control("x"), {LoadModel: refuse, Drain: missing})
    with pytest.raises(Unavailable) as e:
        await bus.request(s.te_control("x"), LoadModel(model="m", path="/p"), ControlAck, timeout=2)
    assert e.value.retryable and e.value.retry_after_s == 7
    with pytest.raises(NotFound) as e2:
        await bus.request(s.te_control("x"), Drain(), ControlAck, timeout=2)
    assert e2.value.param == "model" and e2.value.status == 404


async def test_a_crashing_handler_answers_with_an_internal_error(bus: Bus, cluster: str):
    s = Subjects(cluster)

    async def broken(msg: Drain) -> ControlAck:
        raise RuntimeError("boom")

    await bus.subscribe(s.te_control("y"), {Drain: broken})
    with pytest.raises(Exception) as e:
        await bus.request(s.te_control("y"), Drain(), ControlAck, timeout=2)
    assert e.value.status == 500 and "boom" in str(e.value)


async def test_undecodable_message_gets_bad_request(bus: Bus, cluster: str):
    s = Subjects(cluster)

    async def on_load(msg: LoadModel) -> ControlAck:
        return ControlAck(te_id="z", ok=True)

    await bus.subscribe(s.te_control("z"), {LoadModel: on_load})
    # A Leave is a valid message, but not one this subject takes.
    with pytest.raises(BadRequest):
        await bus.request(s.te_control("z"), Leave(member_id="q"), ControlAck, timeout=2)


async def test_nobody_listening_is_unavailable(bus: Bus, cluster: str):
    with pytest.raises(Unavailable):
        await bus.request(Subjects(cluster).get_view(), GetView(), ControlAck, timeout=1)


async def test_clusters_do_not_see_each_other(bus: Bus, cluster: str):
    a, b = Subjects(cluster + "a"), Subjects(cluster + "b")
    got: list[str] = []

    async def on_leave(msg: Leave) -> None:
        got.append(msg.member_id)

    await bus.subscribe(a.heartbeat(), {Leave: on_leave})
    await bus.publish(b.heartbeat(), Leave(member_id="from-b"))
    await bus.publish(a.heartbeat(), Leave(member_id="from-a"))
    await bus.flush()
    for _ in range(50):
        if got:
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.1)
    assert got == ["from-a"]


async def test_concurrent_handlers_do_not_block_each_other(bus: Bus, cluster: str):
    s = Subjects(cluster)
    release = asyncio.Event()

    async def slow(msg: LoadModel) -> ControlAck:
        if msg.model == "slow":
            await release.wait()
        return ControlAck(te_id=msg.model, ok=True)

    await bus.subscribe(s.te_control("c"), {LoadModel: slow}, concurrent=True)
    slow_call = asyncio.create_task(
        bus.request(s.te_control("c"), LoadModel(model="slow", path=""), ControlAck, timeout=5)
    )
    fast = await bus.request(
        s.te_control("c"), LoadModel(model="fast", path=""), ControlAck, timeout=2
    )
    assert fast.te_id == "fast" and not slow_call.done()
    release.set()
    assert (await slow_call).te_id == "slow"


def test_error_reply_round_trip():
    from shared.errors import from_reply
    from shared.messages.base import decoder_for, encode

    reply = Unavailable("x", retry_after_s=3).to_reply()
    back = decoder_for(TaskAccepted, ErrorReply).decode(encode(reply))
    err = from_reply(back)
    assert isinstance(err, Unavailable) and err.retry_after_s == 3
    assert SamplingParams(max_tokens=3).temperature == 1.0


async def test_reply_inboxes_carry_the_cluster_name(bus: Bus, cluster: str):
    assert bus.new_inbox().startswith(f"{cluster}._INBOX.")

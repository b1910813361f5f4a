"""One executor per device (``services/task_executor/device_arbiter.py``), over a real Unix
socket: one turn at a time per device, the next to the earliest deadline among the TEs
waiting, a TE between iterations holds nothing, a TE that leaves gives its turn back,
devices are independent, late turns are counted; turns are served only where one
iteration fills the device; under a KV budget, a grow (and a load's first pool) waits for
the shrink that makes its room."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from services.task_executor.device_arbiter import (
    KV_PREEMPTIONS,
    LATE_TURNS,
    DeviceArbiter,
    Instance,
    TurnClient,
    serves_arbiter,
    shares_device,
    snapshot_views,
)
from services.task_executor.task_loop import books_device
from shared.headroom import RequestView, Urgency
from shared.messages.base import decoder_for, encode
from shared.messages.devices import DeviceInstance, DeviceRequest, DeviceSnapshot
from shared.messages.tasks import TaskMode
from shared.settings import Settings
from tests.unit.exact_perf import EXACT_PERF


@pytest.fixture
async def arbiter(tmp_path: Path) -> AsyncIterator[DeviceArbiter]:
    a = DeviceArbiter(tmp_path / "turns")
    await a.start()
    yield a
    await a.stop()


class _Turn:
    """A turn being asked for or held by a test's TE."""

    def __init__(
        self,
        client: TurnClient,
        claim: Urgency | float,
        device: str = "cpu",
        requests: list[RequestView] | None = None,
    ) -> None:
        self._cm = client.turn(claim, device, requests)
        self.entered = asyncio.create_task(self._cm.__aenter__())

    async def granted(self) -> bool:
        """Whether the turn is granted, waiting up to a second for it (a grant takes
        milliseconds, but a garbage collection of the test process may hold it for tens)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.entered), 1.0)
        return self.entered.done()

    async def waiting(self) -> bool:
        """Whether the turn is still not granted 50 ms on (it waits for another's)."""
        await asyncio.sleep(0.05)
        return not self.entered.done()

    async def end(self) -> None:
        await self.entered
        await self._cm.__aexit__(None, None, None)


async def test_the_turn_goes_to_the_earliest_deadline_waiting(arbiter: DeviceArbiter) -> None:
    a, b, c = (TurnClient(str(arbiter.path), n) for n in "abc")
    turn_a = _Turn(a, 100.0)
    assert await turn_a.granted()
    turn_b, turn_c = _Turn(b, 10.0), _Turn(c, 5.0)
    assert await turn_b.waiting() and await turn_c.waiting()  # a holds it
    await turn_a.end()
    assert await turn_c.granted() and await turn_b.waiting()  # 5 before 10
    again_a = _Turn(a, 1.0)  # a asks again, most urgent now
    assert await again_a.waiting()
    await turn_c.end()
    assert await again_a.granted() and await turn_b.waiting()
    await again_a.end()
    assert await turn_b.granted()
    await turn_b.end()
    for client in (a, b, c):
        client.close()


async def test_a_te_whose_most_urgent_prompt_yields_waits_for_those_in_time(
    arbiter: DeviceArbiter,
) -> None:
    """``want <deadline> yield``: its most urgent request is a prompt late by less than the
    late yield (its engine serves it behind its prompts in time), so the turn goes first to
    a TE with a later deadline still in time; what it holds is read all the same."""
    a, b, c = (TurnClient(str(arbiter.path), n) for n in "abc")
    turn_a = _Turn(a, 100.0)
    assert await turn_a.granted()
    prompt = RequestView(
        arrival=1.0, prompt_tokens=10, expected_output=5, ttft_slo=2.0, tpot_slo=0.1, id="p"
    )
    turn_b = _Turn(b, Urgency(True, 3.0), requests=[prompt])
    turn_c = _Turn(c, 10.0)
    assert await turn_b.waiting() and await turn_c.waiting()
    assert arbiter._devices["cpu"].clients["b"].requests == (prompt,)
    await turn_a.end()
    assert await turn_c.granted() and await turn_b.waiting()  # 10 in time before 3 yielding
    await turn_c.end()
    assert await turn_b.granted()
    await turn_b.end()
    for client in (a, b, c):
        client.close()


async def test_a_te_between_iterations_does_not_hold_the_device(arbiter: DeviceArbiter) -> None:
    """Work-conserving: when a's iteration ends, b (waiting) runs, even though a is about to
    ask again with an earlier deadline."""
    a, b = TurnClient(str(arbiter.path), "a"), TurnClient(str(arbiter.path), "b")
    turn_a = _Turn(a, 1.0)
    assert await turn_a.granted()
    turn_b = _Turn(b, 5.0)
    assert await turn_b.waiting()
    await turn_a.end()
    assert await turn_b.granted()
    again_a = _Turn(a, 2.0)
    assert await again_a.waiting()
    await turn_b.end()
    assert await again_a.granted()
    await again_a.end()
    a.close()
    b.close()


async def test_a_te_that_goes_away_gives_its_turn_back(arbiter: DeviceArbiter) -> None:
    a, b = TurnClient(str(arbiter.path), "a"), TurnClient(str(arbiter.path), "b")
    turn_a = _Turn(a, 1.0)  # held (and never ended)
    assert await turn_a.granted()
    turn_b = _Turn(b, 5.0)
    assert await turn_b.waiting()
    a.close()  # its process died: the connection drops
    assert await turn_b.granted()
    b.close()


async def test_devices_do_not_wait_for_each_other(arbiter: DeviceArbiter) -> None:
    gpu0, gpu1 = TurnClient(str(arbiter.path), "g0"), TurnClient(str(arbiter.path), "g1")
    held = _Turn(gpu0, 1.0, "cuda:0")
    assert await held.granted()
    assert await _Turn(gpu1, 1.0, "cuda:1").granted()
    gpu0.close()
    gpu1.close()


async def test_a_turn_past_its_deadline_is_counted_late(arbiter: DeviceArbiter) -> None:
    late = LATE_TURNS.labels("cpu")
    before = late._value.get()
    a = TurnClient(str(arbiter.path), "a")
    async with a.turn(time.monotonic() + 60, "cpu"):
        pass
    async with a.turn(time.monotonic() - 1, "cpu"):  # its most urgent request is overdue
        pass
    assert late._value.get() == before + 1
    a.close()


async def test_without_an_arbiter_turns_are_granted_at_once(tmp_path: Path) -> None:
    for client in (TurnClient("", "a"), TurnClient(str(tmp_path / "nobody"), "a")):
        for _ in range(2):  # an arbiter that is not there: off, and stays off
            await asyncio.wait_for(_Turn(client, 1.0).entered, 1)


@pytest.mark.parametrize(
    ("values", "pays"),
    [
        ({"device": "cpu", "torch_threads": 0}, True),  # each TE's threads fill the cores
        ({"device": "cpu", "torch_threads": 1}, False),  # 2 TEs x 1 thread on 2 cores
        ({"device": "cpu", "torch_threads": 2}, True),
        ({"device": "cuda"}, True),
        ({"device": "auto", "torch_threads": 1}, True),  # may be a GPU
        ({"device": "cpu", "torch_threads": 0, "pool_size": 1}, False),
        ({"device": "cpu", "torch_threads": 0, "device_turns": False}, False),
    ],
)
def test_turns_are_served_where_one_iteration_fills_the_device(values: dict, pays: bool) -> None:
    te = Settings.load(**({"pool_size": 2} | values)).task_executor
    assert shares_device(te, cores=2) is pays


@pytest.mark.parametrize(
    ("values", "serves"),
    [
        ({"pool_size": 2, "device": "cuda"}, True),  # turns
        ({"pool_size": 1}, False),
        ({"pool_size": 1, "shadow_admission": True}, True),  # observes
        ({"pool_size": 1, "kv_preemption": True}, True),
        ({"pool_size": 2, "torch_threads": 1, "kv_preemption": True}, True),  # threads fit
        ({"pool_size": 1, "device_turns": False, "shadow_admission": True}, True),
    ],
)
def test_a_pool_serves_an_arbiter_for_turns_or_to_observe(values: dict, serves: bool) -> None:
    te = Settings.load(**values).task_executor
    assert serves_arbiter(te, cores=2) is serves


async def test_an_arbiter_that_observes_plays_each_te_as_a_device_of_its_own(
    tmp_path: Path,
) -> None:
    """No turns: a TE's turn is granted while another's is held; each TE is a device of its
    own in the snapshots (other pools' plays) and in its own checks (a neighbour's long
    queue does not make a new request late); no KV books, whatever the budget."""
    arbiter = DeviceArbiter(tmp_path / "observe", kv_budget_bytes=1000, turns=False)
    await arbiter.start()
    assert arbiter.kv_budget_bytes == 0
    a, b = TurnClient(str(arbiter.path), "a"), TurnClient(str(arbiter.path), "b")
    turn_a = _Turn(a, 100.0)
    assert await turn_a.granted()
    turn_b = _Turn(b, 10.0)
    assert await turn_b.granted()  # not after a's: a device of its own
    await turn_a.end()
    await turn_b.end()
    now = time.monotonic()
    # a: 40 requests of 2,000-token prompts still to prefill (seconds of work); b: idle.
    queued = [
        dataclasses.replace(_request(f"q{k}", now), computed_tokens=0, output_tokens=0)
        for k in range(40)
    ]
    queued = [dataclasses.replace(r, prompt_tokens=2000) for r in queued]
    _serving(a, "m1", *queued)
    _serving(b, "m1")
    assert await _until(lambda: len(arbiter.snapshots("p")) == 2)
    snaps = {s.device: [i.te_id for i in s.instances] for s in arbiter.snapshots("p")}
    assert snaps == {"cpu#a": ["a"], "cpu#b": ["b"]}
    new = dataclasses.replace(_request("n", now), computed_tokens=0, output_tokens=0, ttft_slo=1.0)
    assert (await b.check(new, "cpu")).ok  # b plays alone: a's queue is not its
    assert not (await a.check(new, "cpu")).ok  # behind a's queue it would be late
    assert math.isinf(b.kv_room)  # no books: it holds what it will
    a.close()
    b.close()
    await arbiter.stop()


async def test_a_te_slower_than_its_profile_is_stretched(arbiter: DeviceArbiter) -> None:
    """The arbiter times each turn against what the TE's profile predicts for the requests
    it held, and moves the TE's stretch toward the ratio."""
    perf = EXACT_PERF  # a decode step 10 ms
    a = TurnClient(str(arbiter.path), "a")
    a.serving(Instance(perf=perf, max_num_seqs=32, max_prefill_tokens=2048))
    decoding = RequestView(
        arrival=0.0,
        prompt_tokens=10,
        expected_output=50,
        ttft_slo=2.0,
        tpot_slo=0.25,
        computed_tokens=10,
        output_tokens=3,
        id="r",
    )
    async with a.turn(time.monotonic() + 10, "cpu", [decoding]):
        await asyncio.sleep(0.05)  # five times the profile's step
    await asyncio.sleep(0.05)  # the "done" reaches the arbiter
    stretch = arbiter._devices["cpu"].clients["a"].stretch
    assert 1.3 < stretch < 3.0  # 1 + 0.1 x (5 - 1) = 1.4, a slower sleep a little more
    a.close()


# --- the device's KV memory (MESHSERVE_DEVICE_KV_BYTES) ---------------------------------


@pytest.fixture
async def budgeted(tmp_path: Path) -> AsyncIterator[DeviceArbiter]:
    a = DeviceArbiter(tmp_path / "turns", kv_budget_bytes=1000)
    await a.start()
    yield a
    await a.stop()


async def _te(arbiter: DeviceArbiter, name: str, holds: int) -> TurnClient:
    """A TE connected to the arbiter (after one turn) whose KV pool holds ``holds`` bytes."""
    client = TurnClient(str(arbiter.path), name)
    async with client.turn(1e18, "cpu"):
        pass
    client.kv_hold(holds)
    return client


async def _until(cond: Callable[[], bool]) -> bool:
    for _ in range(100):
        if cond():
            return True
        await asyncio.sleep(0.01)
    return cond()


async def test_a_grow_waits_for_the_shrink_that_makes_its_room(budgeted: DeviceArbiter) -> None:
    """600 + 300 of 1,000 bytes held: b's grow to 600 takes the 100 free and waits for the
    rest, a is told to shrink, and b gets the rest only once a says it holds less."""
    squeezed: list[str] = []
    a = await _te(budgeted, "a", 600)
    a.on_squeeze = lambda: squeezed.append("a")
    b = await _te(budgeted, "b", 300)
    assert b.kv_room == 300
    b.kv_need(600, deadline=5.0)
    assert await _until(lambda: squeezed == ["a"])
    assert await _until(lambda: b.kv_room == 400)  # what was free, no more before the shrink
    assert a.take_squeeze() and not a.take_squeeze()
    a.kv_hold(200)
    assert await _until(lambda: b.kv_room == 600)
    b.kv_hold(600)
    # Room freed by a TE that goes away serves the next grow.
    a.kv_need(500, deadline=1.0)
    assert await _until(lambda: a.kv_room == 400)  # the 200 free; the rest waits
    await asyncio.sleep(0.05)
    assert a.kv_room == 400
    b.close()
    assert await _until(lambda: a.kv_room == 500)
    a.close()


async def test_a_grow_granted_in_part_waits_since_its_first_ask(budgeted: DeviceArbiter) -> None:
    """b grows into the part it got and asks for the rest: that ask counts from the first
    (the room-wait histogram, and the second a grow waits before it may preempt); a grow
    withdrawn and asked for later starts afresh."""
    a = await _te(budgeted, "a", 600)  # busy: it does not shrink when told
    b = await _te(budgeted, "b", 300)
    b.kv_need(600, deadline=5.0)
    assert await _until(lambda: b.kv_room == 400)
    entry = budgeted._devices["cpu"].clients["b"]
    first = entry.need_at
    await asyncio.sleep(0.05)
    b.kv_hold(400)  # it grew into what it got, and asks for the rest at once
    b.kv_need(600, deadline=5.0)
    assert await _until(lambda: entry.need is not None and entry.holds == 400)
    assert entry.need_at == first
    b.kv_enough()  # withdrawn
    assert await _until(lambda: entry.need is None)
    await asyncio.sleep(0.05)
    b.kv_need(700, deadline=5.0)
    assert await _until(lambda: entry.need is not None)
    assert entry.need_at > first + 0.05
    a.close()
    b.close()


async def test_grows_go_most_urgent_first_and_none_overtakes_one_that_waits(
    budgeted: DeviceArbiter,
) -> None:
    a = await _te(budgeted, "a", 500)
    b = await _te(budgeted, "b", 0)
    c = await _te(budgeted, "c", 0)
    d = await _te(budgeted, "d", 0)
    # 500 free: c (due first) gets its 100; b's 600 does not fit: it takes the 400 left and
    # waits for the rest; d's 50, due after b, waits behind it (a large grow is never
    # starved by small ones).
    c.kv_need(100, deadline=1.0)
    b.kv_need(600, deadline=2.0)
    await asyncio.sleep(0.05)
    d.kv_need(50, deadline=3.0)
    assert await _until(lambda: c.kv_room == 100)
    await asyncio.sleep(0.05)
    assert b.kv_room == 400 and d.kv_room == 0
    assert a.take_squeeze() and not c.take_squeeze()  # c holds nothing yet, only room
    a.kv_hold(100)
    assert await _until(lambda: b.kv_room == 600 and d.kv_room == 50)
    for te in (a, b, c, d):
        te.close()


async def test_a_grow_no_longer_wanted_is_withdrawn_and_stops_holding_up_the_next(
    budgeted: DeviceArbiter,
) -> None:
    a = await _te(budgeted, "a", 700)  # busy: it does not shrink when told
    b = await _te(budgeted, "b", 300)
    c = await _te(budgeted, "c", 0)
    b.kv_need(600, deadline=1.0)  # nothing free: it waits
    await asyncio.sleep(0.05)
    c.kv_need(50, deadline=2.0)  # behind b
    await asyncio.sleep(0.05)
    assert c.kv_room == 0 and budgeted._devices["cpu"].clients["b"].need is not None
    a.kv_hold(650)  # a gave back 50: b, first in line, takes it
    assert await _until(lambda: b.kv_room == 350)
    b.kv_enough()  # b's requests ended: it wants no more, and says what it holds
    assert await _until(lambda: budgeted._devices["cpu"].clients["b"].need is None)
    assert _books(budgeted, "b") == 300  # the part granted and unused goes back
    assert await _until(lambda: c.kv_room == 50)
    b.kv_enough()  # nothing asked: nothing said
    for te in (a, b, c):
        te.close()


async def test_without_a_budget_a_grow_has_room_at_once(arbiter: DeviceArbiter) -> None:
    a = await _te(arbiter, "a", 10**12)
    a.kv_need(2 * 10**12, deadline=1.0)
    assert await _until(lambda: a.kv_room == 2 * 10**12)
    a.close()
    assert TurnClient("", "off").kv_room == math.inf  # no arbiter: no bound


def _books(arbiter: DeviceArbiter, name: str) -> int:
    """What the arbiter's books count for ``name``: held and granted."""
    client = arbiter._devices["cpu"].clients[name]
    return client.holds + client.reserved


async def test_a_load_reserves_its_kv_after_the_shrink_that_makes_room(
    budgeted: DeviceArbiter,
) -> None:
    """900 of 1,000 bytes held: a new TE's load (holding nothing) waits for the 400 bytes of
    its pool's floor; the other TE is told to shrink, and once it holds 500 the load's room
    is in the books before its engine exists."""
    a = await _te(budgeted, "a", 900)
    a.on_squeeze = lambda: a.kv_hold(500)  # it shrinks to its demand when told
    b = TurnClient(str(budgeted.path), "b")
    assert await b.kv_reserve(400, "cpu", deadline=1.0, wait_s=2.0)
    assert _books(budgeted, "a") == 500 and _books(budgeted, "b") == 400
    b.kv_hold(380)  # the load's pool, as it first sized itself: the reservation's place
    assert await _until(lambda: _books(budgeted, "b") == 380)
    a.close()
    b.close()


async def test_a_load_that_finds_no_room_in_time_withdraws_its_ask(
    budgeted: DeviceArbiter,
) -> None:
    a = await _te(budgeted, "a", 900)  # busy: it does not shrink when told
    b = TurnClient(str(budgeted.path), "b")
    t = time.monotonic()
    assert not await b.kv_reserve(400, "cpu", deadline=1.0, wait_s=0.3)
    assert 0.3 <= time.monotonic() - t < 2.0
    assert a.take_squeeze()  # it was told
    assert await _until(lambda: budgeted._devices["cpu"].clients["b"].need is None)
    assert _books(budgeted, "b") == 0
    a.close()
    b.close()


async def test_without_an_arbiter_a_load_reserves_nothing(tmp_path: Path) -> None:
    assert await TurnClient("", "off").kv_reserve(400, "cpu", deadline=1.0, wait_s=0.1)
    gone = TurnClient(str(tmp_path / "nobody"), "x")  # an arbiter that is not there
    assert await gone.kv_reserve(400, "cpu", deadline=1.0, wait_s=0.1)


async def test_every_te_of_the_device_hears_what_its_books_leave_free(
    budgeted: DeviceArbiter,
) -> None:
    """What a pool could still grow into, so that its TE reports it (a pool at its floor is
    not a full one): the budget (1,000) less what the pools hold and were granted."""
    a = await _te(budgeted, "a", 600)
    b = await _te(budgeted, "b", 300)
    assert await _until(lambda: a.kv_device_free == 100 and b.kv_device_free == 100)
    b.kv_need(350, deadline=1.0)  # granted at once: 50 more in the books
    assert await _until(lambda: a.kv_device_free == 50)
    b.close()  # its memory goes back
    assert await _until(lambda: a.kv_device_free == 400)
    a.close()
    assert TurnClient("", "off").kv_device_free == math.inf


async def test_a_te_hears_the_books_free_memory_as_it_connects(budgeted: DeviceArbiter) -> None:
    """An idle TE (no pool yet) hears what the books leave free as soon as it connects: it
    reports it, and the scaler places a load where there is room for it."""
    a = await _te(budgeted, "a", 600)
    idle = TurnClient(str(budgeted.path), "idle")
    assert idle.kv_device_free == math.inf
    await idle.announce("cpu")
    assert await _until(lambda: idle.kv_device_free == 400)
    a.close()
    idle.close()


async def test_a_room_granted_before_the_arbiter_read_a_later_hold_is_void(
    tmp_path: Path,
) -> None:
    """The arbiter grants room, then reads the TE's next hold, which resets its books (the
    grant may go to another TE): the TE must not grow into that room. Each hold is
    numbered and each room says the last hold the arbiter had read."""
    writers: list[asyncio.StreamWriter] = []
    said: list[str] = []

    async def arbiter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        while line := await reader.readline():
            said.append(line.decode().strip())
            if line.startswith(b"want"):
                writer.write(b"go\n")

    server = await asyncio.start_unix_server(arbiter, path=str(tmp_path / "a.sock"))
    te = TurnClient(str(tmp_path / "a.sock"), "a")
    async with te.turn(1e18, "cpu"):
        pass
    te.kv_hold(100)
    te.kv_need(300, deadline=1.0)
    assert await _until(
        lambda: "hold 100 1" in said and any(s.startswith("need 300") for s in said)
    )
    writers[0].write(b"room 250 0\n")  # granted before it read "hold 100 1"
    await asyncio.sleep(0.05)
    assert te.kv_room == 100
    writers[0].write(b"room 200 1\n")
    assert await _until(lambda: te.kv_room == 200)
    te.close()
    server.close()


# --- preemption for a blocked grow (MESHSERVE_KV_PREEMPTION) ----------------------------


def _request(rid: str, now: float, output_tokens: int = 10) -> RequestView:
    return RequestView(
        arrival=now,
        prompt_tokens=100,
        expected_output=50,
        ttft_slo=10.0,
        tpot_slo=0.1,
        computed_tokens=100,
        output_tokens=output_tokens,
        id=rid,
    )


def _serving(client: TurnClient, model: str, *requests: RequestView) -> None:
    client.serving(Instance(perf=EXACT_PERF, max_num_seqs=32, max_prefill_tokens=2048, model=model))
    client.requests(requests)


async def _away(tmp_path: Path, now: float) -> DeviceSnapshot:
    """Another pool's device holding an idle instance of m2, as its pool publishes it (over
    msgpack, as the bus carries it)."""
    other = DeviceArbiter(tmp_path / "other")
    await other.start()
    away = await _te(other, "m2-away", 0)
    _serving(away, "m2")
    assert await _until(lambda: bool(other.snapshots("pool-b")))
    (snapshot,) = other.snapshots("pool-b")
    away.close()
    await other.stop()
    assert snapshot.pool_id == "pool-b" and [i.model for i in snapshot.instances] == ["m2"]
    return decoder_for(DeviceSnapshot).decode(encode(snapshot))


async def test_a_blocked_grow_preempts_a_smaller_neighbour_whose_requests_fit_elsewhere(
    budgeted: DeviceArbiter, tmp_path: Path
) -> None:
    """1,000 bytes: big (m1, three requests) holds 500, small (m2, one request) 400. Big's
    grow to 1,100 takes the 100 free and waits; small is told to shrink and cannot. A second
    on, with another pool's device holding an idle instance of m2, small is told to
    preempt itself (its request validates there); not before, and not with nowhere to go."""
    now = time.monotonic()
    big = await _te(budgeted, "big", 500)
    _serving(big, "m1", *(_request(f"b{k}", now) for k in range(3)))
    small = await _te(budgeted, "small", 400)
    _serving(small, "m2", _request("s1", now))
    preempted: list[tuple[str, dict[str, str]]] = []
    small.on_preempt = lambda moves: preempted.append(("small", moves))
    big.on_preempt = lambda moves: preempted.append(("big", moves))
    big.kv_need(1100, deadline=now + 1)
    assert await _until(lambda: small.take_squeeze())  # told, and it holds on
    away = snapshot_views(await _away(tmp_path, now), time.monotonic())
    before = KV_PREEMPTIONS.labels("cpu")._value.get()
    assert budgeted.preempt_blocked([away], time.monotonic()) == []  # not a second yet
    later = time.monotonic() + 1.1
    assert budgeted.preempt_blocked([], later) == []  # nowhere for s1 to go
    assert budgeted.preempt_blocked([away], later + 0.5) == []  # looked at once a second
    (decided,) = budgeted.preempt_blocked([away], later + 1.1)
    assert decided.neighbour == "small" and decided.moves == {"s1": "m2-away"}
    # Small hears where its request validated: it hands it back naming that TE.
    assert await _until(lambda: preempted == [("small", {"s1": "m2-away"})])
    assert KV_PREEMPTIONS.labels("cpu")._value.get() == before + 1
    # Told once: it takes no requests in other pools' plays, and is not preempted again.
    assert [i.te_id for s in budgeted.snapshots("pool-a") for i in s.instances] == ["big"]
    assert budgeted.preempt_blocked([away], later + 2.5) == []
    small.kv_hold(0)  # unloaded: its KV goes to the grow
    small.serving(None)
    assert await _until(lambda: big.kv_room == 1000)
    big.close()
    small.close()


def test_another_pools_request_times_move_onto_this_hosts_clock() -> None:
    snapshot = DeviceSnapshot(
        pool_id="p",
        device="cuda:0",
        at=100.0,
        instances=[
            DeviceInstance(
                te_id="t",
                model="m",
                perf=EXACT_PERF,
                max_num_seqs=8,
                max_prefill_tokens=512,
                requests=[DeviceRequest(90.0, 100, 50, 2.0, 0.1, 100, 3, "r")],
            ),
            DeviceInstance(
                te_id="p",
                model="m",
                role=TaskMode.PREFILL,
                perf=EXACT_PERF,
                max_num_seqs=8,
                max_prefill_tokens=512,
            ),
        ],
    )
    views, takes = snapshot_views(snapshot, 5000.0)
    assert views[0].requests == (RequestView(4990.0, 100, 50, 2.0, 0.1, 100, 3, "r"),)
    assert takes == {"t": "m"}  # a prefill instance takes no request of another's


def test_a_te_names_its_pools_device_to_the_books_as_its_engine_will() -> None:
    """Before its engine exists (the books, a load's reservation) a TE names the pool's
    device as the torch engine will: auto is a GPU where there is one, with its index."""
    import torch

    assert books_device(Settings.load(device="cpu").task_executor) == "cpu"
    auto = books_device(Settings.load(device="auto").task_executor)
    assert auto == ("cuda:0" if torch.cuda.is_available() else "cpu")

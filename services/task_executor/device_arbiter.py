"""One executor per device (LLM-Mesh): the TEs of a node pool that share a device (the
cores the pool owns, or one GPU) run their engine iterations one at a time, and the next
turn goes to the TE holding the request with the least headroom (``shared.headroom``).

Why an arbiter and not several engines in one process: a TE stays one process serving one
model (a crash takes one model down, not the device's others; the cluster sees the same
one-model-per-instance TEs as before), and what it shares is only *when* it runs. Each
iteration is short (milliseconds), so asking costs little: a line over a Unix socket each
way, tens of microseconds beside iterations of milliseconds.

The pool serves the arbiter on a Unix socket (its path goes to its TEs as
``MESHSERVE_DEVICE_ARBITER``). A TE says hello with its id and device, asks for a turn with
its most urgent deadline (``want <deadline>``: monotonic seconds, the host's clock, which
every process on it shares; ``want <deadline> yield`` when that request is a prompt its
engine lets yield, late by less than ``MESHSERVE_LATE_YIELD``: ``shared.headroom.Urgency``),
runs one iteration once told ``go`` and says ``done``. The turn goes to the lowest claim
among the TEs waiting when it frees (the earliest deadline, a yielding one behind all those
still in time): a TE between two iterations (publishing its tokens, taking new requests)
is not waiting, so the device never idles while another TE could run (work-conserving). A
TE that goes away (or whose connection drops) gives its turn back. Turns granted past
their deadline are counted (negative headroom: an SLO miss in the making).

Turns pay where one TE's iteration fills the device (``shares_device``): a GPU, or CPU TEs
whose threads together outnumber the cores. Measured on host A (2 cores, AVX-512 BF16), two
TEs of the 0.5B bench model with torch's default threads decoding 8 requests at once
(the setup of tests/integration/test_device_turns.py, timed by hand; ``scripts/bench-sharing``
is to measure it properly): 3.6 s with turns against 7.5-12.4 s competing for the cores; on
the tiny demo model, whose iterations are mostly Python, turns cost 10-20%. With one thread per TE on two cores the
TEs run side by side and the pool serves no turns.

With ``MESHSERVE_SHADOW_ADMISSION`` the arbiter also validates: a TE tells it what it
serves (``instance``: its performance model and limits) and, with each ``want``, the
requests it holds; before taking a request it asks ``check`` and the arbiter plays the
device's next iterations forward (``services/job_executor/shadow.py``) over every TE of
the device, answering with a ``verdict``. Each TE's profile is stretched by how its real
iterations compare with it (the arbiter times every turn against the profile's
prediction for the requests the TE held: a moving mean, ``stretch``), so that the play
counts what the profile, measured on an idle device, does not: other processes'
overheads, the host's load.

With ``MESHSERVE_KV_SIZING`` and a device KV budget (``MESHSERVE_DEVICE_KV_BYTES``) the
arbiter also keeps the device's memory: each TE says what its KV pool holds (``hold
<bytes> <n>``, after every resize, numbered) and asks before it grows (``need <bytes>
<deadline>``: the size it wants); the arbiter grants room (``room <bytes> <n>``: the most it
may hold now, with the number of the last hold it read: a room granted before a later hold
reset the books is void) as ``kv_sizing.make_room`` orders the waiting grows over what is
free: a grow only into memory a finished shrink gave back, the most urgent first, none
overtaking one that waits, the first that does not fit taking what is free and waiting for
the rest. While one waits, the device's other TEs are told to shrink to their demand at
once (``squeeze``); what they give back comes as their next ``hold``. A TE whose demand
fell withdraws its ask by saying what it holds. A TE about to load a model holds nothing and
asks the same way for its new pool's floor (``kv_reserve``), so a load waits for room like a
grow (and holds a part of it meanwhile). Every TE hears what the books leave free (``free
<bytes>``), which it reports as room its pool could grow into. With
``MESHSERVE_KV_PREEMPTION`` a grow blocked past a second may have a smaller neighbour
preempted (``preempt_blocked``): the neighbour hears ``preempt <moves>`` (a JSON object:
each of its requests' key -> the TE it validated on), hands its requests back naming those
TEs, and unloads.

A pool whose TEs do not share a device (one TE, or CPU TEs whose threads fit the cores)
serves no turns, but with shadow validation or KV preemption on it still serves an arbiter
that only observes (``turns=False``, ``serves_arbiter``): each TE is a device of its own
(named ``<device>#<te>``, its turns granted at once, never waiting for another's), its
``check``s play that TE alone, its snapshots tell other pools what each TE holds (a place a
preempted neighbour's requests may go), and it keeps no KV books (its TEs' pools are bound
each by MESHSERVE_KV_CACHE_BYTES, as without an arbiter). What it costs a TE is one round
trip on the socket per iteration: 0.11 ms on host B with a test suite running beside it,
as a turn costs (``turn`` timed 2,000 times, arbiter and TE on one uvloop).

The TE's side is ``TurnClient``; without an arbiter (or once its connection fails) a TE
runs its iterations unarbitrated, and takes every request, as before."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path

import msgspec
from prometheus_client import Counter, Histogram

from services.job_executor.shadow import InstanceView, Verdict, iteration_s, validate
from services.task_executor.kv_sizing import (
    PREEMPT_AFTER_S,
    DeviceOp,
    Neighbour,
    Preemption,
    Room,
    elsewhere,
    make_room,
    preemption,
)
from shared.headroom import NO_WORK, RequestView, Urgency, next_turn
from shared.logging import get_logger
from shared.messages.devices import DeviceInstance, DeviceRequest, DeviceSnapshot
from shared.messages.tasks import TaskMode
from shared.perf_model import PerfModel
from shared.settings import TaskExecutorSettings

log = get_logger(__name__)

TURNS = Counter(
    "meshserve:device_turns",
    "Engine iterations a node pool's device arbiter granted, by device",
    ["device"],
)
LATE_TURNS = Counter(
    "meshserve:device_late_turns",
    "Turns granted to a TE whose most urgent request was already past its deadline "
    "(negative headroom: an SLO miss), by device",
    ["device"],
)
CHECKS = Counter(
    "meshserve:device_admission_checks",
    "Shadow validations of a request joining an instance on a device, by outcome: admitted, "
    "late (it would miss its TTFT), pushes (it would push a held request past its "
    "deadline), tpot (a decode round of the device would exceed the TPOT)",
    ["device", "outcome"],
)
TURN_WAIT = Histogram(
    "meshserve:device_turn_wait_seconds",
    "Time a TE waited for its turn on its device (an iteration of another TE running)",
    ["device"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)

KV_ROOM_WAIT = Histogram(
    "meshserve:device_kv_room_wait_seconds",
    "Time a TE's KV pool waited for room to grow on its device (MESHSERVE_DEVICE_KV_BYTES)",
    ["device"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
KV_PREEMPTIONS = Counter(
    "meshserve:device_kv_preemptions",
    "TEs told to hand their requests back and unload (MESHSERVE_KV_PREEMPTION): another "
    "TE of the device waited for room to grow, every other pool already squeezed, and each "
    "of the preempted TE's requests validated on another device, by device",
    ["device"],
)
KV_SQUEEZES = Counter(
    "meshserve:device_kv_squeezes",
    "TEs told to shrink their KV pool to its demand at once, another TE of the device "
    "waiting for room to grow, by device",
    ["device"],
)


class NoKvRoom(RuntimeError):
    """A model load found no room for its KV pool in the device's books in time."""


# A TE's stretch: a moving mean over about its last 1 / STRETCH_WEIGHT turns, bounded.
STRETCH_WEIGHT = 0.1
STRETCH_MIN, STRETCH_MAX = 0.5, 20.0


@dataclasses.dataclass(slots=True)
class _Client:
    name: str
    device: str
    writer: asyncio.StreamWriter
    wants: Urgency | None = None  # its claim as it asked (None: not asking)
    asked_at: float = 0.0
    # For shadow validation: its instance (None: it serves nothing, or has no performance
    # model) and its requests as it last said.
    instance: Instance | None = None
    requests: tuple[RequestView, ...] = ()
    # Its real iterations over its profile's predictions (a moving mean; see STRETCH_*), and
    # the turn it holds: when it was granted and what its profile predicted for it.
    stretch: float = 1.0
    granted_at: float = 0.0
    predicted_s: float = 0.0
    # Its KV pool under the device's budget: the bytes it holds (as it last said), the room
    # granted beyond them, the grow it waits for (and since when), whether it was squeezed.
    holds: int = 0
    reserved: int = 0
    need: DeviceOp | None = None
    need_at: float = 0.0
    asked_since: float | None = None  # a partly granted grow's first ask, until it asks again
    squeezed: bool = False
    told_free: int | None = None  # the device's free KV bytes as it was last told
    hold_number: int = 0  # the number of its last "hold", echoed in each "room"
    preempted: bool = False  # told to hand its requests back and unload

    def view(self) -> InstanceView | None:
        if self.instance is None:
            return None
        return InstanceView(
            instance=self.name,
            perf=self.instance.perf,
            requests=self.requests,
            max_num_seqs=self.instance.max_num_seqs,
            max_prefill_tokens=self.instance.max_prefill_tokens,
            stretch=self.stretch,
            late_yield_s=self.instance.late_yield_s,
        )

    def turn_ended(self, now: float) -> None:
        """Its turn's iteration took ``now - granted_at``: its stretch moves toward that over
        what was predicted."""
        if self.predicted_s > 0:
            ratio = (now - self.granted_at) / self.predicted_s
            ratio = min(max(ratio, STRETCH_MIN), STRETCH_MAX)
            self.stretch += STRETCH_WEIGHT * (ratio - self.stretch)
        self.predicted_s = 0.0


@dataclasses.dataclass(slots=True)
class _Device:
    holder: _Client | None = None
    waiting: dict[str, _Client] = dataclasses.field(default_factory=dict)
    clients: dict[str, _Client] = dataclasses.field(default_factory=dict)
    preempt_after: float = 0.0  # when its blocked grow may next be looked at


class Instance(msgspec.Struct, frozen=True):
    """What a TE serves, as shadow validation plays it: its model's performance model and
    its engine's batch and prefill limits."""

    perf: PerfModel
    max_num_seqs: int
    max_prefill_tokens: int
    model: str = ""
    role: TaskMode = TaskMode.COLOCATED
    late_yield_s: float = 0.0  # its engine's (``PrefillPacing.late_yield_s``)


def _used(clients: Iterable[_Client]) -> int:
    """What a device's books gave its TEs' pools: held and granted."""
    return sum(c.holds + c.reserved for c in clients)


def encode_requests(requests: Iterable[RequestView]) -> str:
    return msgspec.json.encode([dataclasses.astuple(r) for r in requests]).decode()


def decode_requests(text: str) -> tuple[RequestView, ...]:
    return tuple(RequestView(*row) for row in msgspec.json.decode(text or "[]"))


def snapshot_views(
    snapshot: DeviceSnapshot, now: float
) -> tuple[tuple[InstanceView, ...], dict[str, str]]:
    """Another pool's device (``DeviceArbiter.snapshots``) as ``Device.views`` gives this
    one's, its requests' times moved onto this host's monotonic clock as of ``now`` (when
    it came: the milliseconds it travelled are not counted)."""
    shift = now - snapshot.at
    views = tuple(
        InstanceView(
            instance=i.te_id,
            perf=i.perf,
            requests=tuple(
                RequestView(r.arrival + shift, *msgspec.structs.astuple(r)[1:]) for r in i.requests
            ),
            max_num_seqs=i.max_num_seqs,
            max_prefill_tokens=i.max_prefill_tokens,
            stretch=i.stretch,
            late_yield_s=i.late_yield_s,
        )
        for i in snapshot.instances
    )
    takes = {i.te_id: i.model for i in snapshot.instances if i.role == TaskMode.COLOCATED}
    return views, takes


# Between a device's name and a TE's in the devices of an arbiter that only observes.
OWN_DEVICE = "#"


def device_label(device: str) -> str:
    """The device a metric counts for: the name a TE gave, without the TE of an observing
    arbiter's own device."""
    return device.partition(OWN_DEVICE)[0]


class DeviceArbiter:
    def __init__(self, path: Path, *, kv_budget_bytes: int = 0, turns: bool = True) -> None:
        """``turns``: the TEs that name one device take turns on it; False: the arbiter
        only observes (every TE a device of its own, no KV books)."""
        self.path = path
        self.turns = turns
        # each device's, for the TEs' KV (0: no bound)
        self.kv_budget_bytes = kv_budget_bytes if turns else 0
        self._devices: dict[str, _Device] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in self._connections.values():
                writer.close()
            await asyncio.gather(*self._connections, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client: _Client | None = None
        me = asyncio.current_task()
        assert me is not None
        self._connections[me] = writer
        try:
            hello = (await reader.readline()).decode().split()
            if len(hello) != 3 or hello[0] != "hello":
                return
            name = hello[2] if self.turns else f"{hello[2]}{OWN_DEVICE}{hello[1]}"
            client = _Client(name=hello[1], device=name, writer=writer)
            device = self._devices.setdefault(client.device, _Device())
            device.clients[client.name] = client
            self._tell_free(device)  # what its pool (or its next load's) could take
            while line := await reader.readline():
                word, _, arg = line.decode().strip().partition(" ")
                if word == "done" and device.holder is client:
                    device.holder = None
                    client.turn_ended(time.monotonic())
                elif word == "want":
                    deadline, _, requests = arg.partition(" ")
                    yielding = requests.startswith("yield")
                    if yielding:
                        requests = requests.removeprefix("yield").lstrip()
                    client.wants = Urgency(yielding, float(deadline))
                    client.asked_at = time.monotonic()
                    if requests:
                        client.requests = decode_requests(requests)
                    device.waiting[client.name] = client
                elif word == "requests":
                    client.requests = decode_requests(arg)
                elif word == "instance":
                    client.instance = (
                        msgspec.json.decode(arg, type=Instance) if arg != "none" else None
                    )
                    client.preempted = False  # it serves anew (or nothing)
                elif word == "hold":
                    held, _, number = arg.partition(" ")
                    # A pool that grew into part of its grow asks for the rest next: that
                    # ask waits since the first (the wait's histogram, preemption's second).
                    # (A withdrawal says the size it holds, grown by nothing.)
                    grew = client.need is not None and int(held) > client.holds
                    client.asked_since = client.need_at if grew else None
                    client.holds, client.reserved = int(held), 0
                    client.need, client.squeezed = None, False
                    client.hold_number = int(number or 0)
                    self._make_room(client.device, device)
                elif word == "need":
                    total, _, urgency = arg.partition(" ")
                    self._ask_room(client, int(total), float(urgency))
                    self._make_room(client.device, device)
                elif word == "check":
                    ask, _, new = arg.partition(" ")
                    verdict = self._check(device, client, decode_requests(new)[0])
                    writer.write(
                        f"verdict {ask} {msgspec.json.encode(verdict).decode()}\n".encode()
                    )
                if word != "hold":
                    client.asked_since = None
                if word in ("hold", "need"):
                    self._tell_free(device)
                self._grant(client.device, device)
        except (OSError, ValueError, UnicodeDecodeError):
            pass
        finally:
            if client is not None:
                device = self._devices[client.device]
                device.waiting.pop(client.name, None)
                device.clients.pop(client.name, None)
                if device.holder is client:
                    device.holder = None
                self._grant(client.device, device)
                self._make_room(client.device, device)
                self._tell_free(device)
            writer.close()
            self._connections.pop(me, None)

    def snapshots(self, pool_id: str) -> list[DeviceSnapshot]:
        """Each device with an instance that shadow validation can play, as other pools'
        arbiters see it (``snapshot_views``): where a neighbour they preempt could send its
        requests."""
        now = time.monotonic()
        out = []
        for name, device in self._devices.items():
            instances = [
                DeviceInstance(
                    te_id=c.name,
                    model=c.instance.model,
                    role=c.instance.role,
                    perf=c.instance.perf,
                    max_num_seqs=c.instance.max_num_seqs,
                    max_prefill_tokens=c.instance.max_prefill_tokens,
                    stretch=c.stretch,
                    late_yield_s=c.instance.late_yield_s,
                    requests=[DeviceRequest(*dataclasses.astuple(r)) for r in c.requests],
                )
                for c in device.clients.values()
                if c.instance is not None and c.instance.model and not c.preempted
            ]
            if instances:
                out.append(
                    DeviceSnapshot(pool_id=pool_id, device=name, at=now, instances=instances)
                )
        return out

    def preempt_blocked(
        self, others: Sequence[tuple[Sequence[InstanceView], Mapping[str, str]]], now: float
    ) -> list[Preemption]:
        """Where a device's first waiting grow has waited ``PREEMPT_AFTER_S`` and every other
        pool of the device was told to shrink already, its TE may preempt a neighbour
        holding fewer requests (``kv_sizing.preemption``): one whose unload frees enough and
        each of whose requests validates on an instance of its model elsewhere (``others``:
        other pools' devices, ``snapshot_views``; this pool's other devices are added, seen
        the same way). The neighbour is told (``preempt``, with the TE each of its requests
        validated on): it hands its requests back, each resubmitted by its frontend from the
        tokens it had and placed on that TE first, and unloads, its KV then going to the
        grow. Each device is looked at once a ``PREEMPT_AFTER_S`` at most."""
        if not self.kv_budget_bytes:
            return []
        decided = []
        for name, device in self._devices.items():
            clients = device.clients.values()
            if now < device.preempt_after or (room := self._room(device)) is None:
                continue
            if not room.wait or room.squeeze:
                continue
            op = room.wait[0]
            blocked = device.clients[op.instance]
            if now - blocked.need_at < PREEMPT_AFTER_S:
                continue
            device.preempt_after = now + PREEMPT_AFTER_S
            mine = blocked.view()
            if mine is None or not blocked.holds or blocked.preempted:
                continue  # a load's reservation, or no performance model: it waits
            neighbours = [
                Neighbour(view, c.instance.model, c.holds)
                for c in clients
                if c is not blocked
                and c.instance is not None
                and c.instance.role == TaskMode.COLOCATED
                and c.holds
                and not c.preempted
                and device.holder is not c  # no iteration in flight
                and (view := c.view()) is not None
            ]
            if not neighbours:
                continue
            here = [snapshot_views(s, s.at) for s in self.snapshots("") if s.device != name]
            devices = [*others, *here]
            targets = elsewhere(devices, {n.model for n in neighbours})
            if not targets:  # no neighbour's model runs anywhere else: none gives way
                continue
            free = max(0, self.kv_budget_bytes - _used(clients))
            chosen = preemption(mine, op.bytes, free, neighbours, targets, now)
            if chosen is None:
                continue
            victim = device.clients[chosen.neighbour]
            victim.preempted = True
            KV_PREEMPTIONS.labels(name).inc()
            log.info(
                "KV preemption: a neighbour hands its requests back and unloads",
                device=name,
                blocked=blocked.name,
                neighbour=victim.name,
                requests=len(chosen.moves),
                targets=sorted(set(chosen.moves.values())),
            )
            self._send(victim, f"preempt {msgspec.json.encode(chosen.moves).decode()}\n")
            decided.append(chosen)
        return decided

    def _check(self, device: _Device, client: _Client, new: RequestView) -> Verdict:
        """Shadow validation of ``new`` joining ``client``'s instance, over every instance of
        the device that has a performance model (``services/job_executor/shadow.py``)."""
        if client.instance is None:
            return Verdict(ok=True)
        instances = [v for c in device.clients.values() if (v := c.view()) is not None]
        verdict = validate(instances, client.name, new, time.monotonic())
        CHECKS.labels(device_label(client.device), verdict.reason or "admitted").inc()
        # JSON has no infinity: a request that would never start is very late instead.
        return dataclasses.replace(verdict, first_token_s=min(verdict.first_token_s, 1e18))

    def _ask_room(self, client: _Client, total: int, urgency: float) -> None:
        """``client`` wants its KV pool to hold ``total`` bytes (never more than the whole
        budget): a grow that waits in ``_make_room``'s order, or room at once where it has it."""
        if self.kv_budget_bytes:
            total = min(total, self.kv_budget_bytes)
        extra = total - client.holds - client.reserved
        if extra <= 0:
            client.need = None
            self._send(client, f"room {client.holds + client.reserved} {client.hold_number}\n")
            return
        if client.need is None:
            since = client.asked_since
            client.need_at = since if since is not None else time.monotonic()
        client.need = DeviceOp("grow", client.name, extra, urgency=urgency)

    def _room(self, device: _Device) -> Room | None:
        """``kv_sizing.make_room`` over the device's waiting grows (None: none waits)."""
        clients = device.clients.values()
        pending = [c.need for c in clients if c.need is not None]
        if not pending:
            return None
        return make_room(
            pending,
            _used(clients),
            self.kv_budget_bytes,
            {c.name: c.squeezed for c in clients if c.holds},
        )

    def _make_room(self, name: str, device: _Device) -> None:
        """Grant the waiting grows that fit (the first that does not, in part), in
        ``kv_sizing.make_room``'s order, over what the device's TEs hold and were granted;
        when one still waits, every other TE holding KV is told to shrink to its demand
        (once, until it says what it holds again)."""
        room = self._room(device)
        if room is None:
            return
        now = time.monotonic()
        rest = {op.instance: op for op in room.wait}  # a grow granted in part waits for the rest
        for op in room.grant:
            client = device.clients[op.instance]
            client.reserved += op.bytes
            client.need = rest.get(op.instance)
            if client.need is None:
                KV_ROOM_WAIT.labels(name).observe(now - client.need_at)
            self._send(client, f"room {client.holds + client.reserved} {client.hold_number}\n")
        for told in room.squeeze:
            client = device.clients[told]
            client.squeezed = True
            KV_SQUEEZES.labels(name).inc()
            self._send(client, "squeeze\n")

    def _tell_free(self, device: _Device) -> None:
        """Each TE of the device hears what its books have not given any pool (``free
        <bytes>``, when it changed): what a pool could still grow into, which the TE reports
        with its own free blocks (``TEHeartbeat.growable_kv_blocks``), so that the router
        does not take a pool at its floor for a full one."""
        if not self.kv_budget_bytes:
            return
        clients = device.clients.values()
        free = max(0, self.kv_budget_bytes - _used(clients))
        for client in clients:
            if client.told_free != free:
                client.told_free = free
                self._send(client, f"free {free}\n")

    @staticmethod
    def _send(client: _Client, line: str) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            client.writer.write(line.encode())

    def _grant(self, name: str, device: _Device) -> None:
        """The turn to the waiting TE with the lowest claim (the earliest deadline), when
        nobody holds it."""
        while device.holder is None and device.waiting:
            chosen = next_turn({n: c.wants or NO_WORK for n, c in device.waiting.items()})
            if chosen is None:  # only TEs asking with no deadline at all: first come
                chosen = next(iter(device.waiting))
            client = device.waiting.pop(chosen)
            now = time.monotonic()
            try:
                client.writer.write(b"go\n")
            except (OSError, RuntimeError):
                continue  # gone: the next one
            device.holder = client
            client.granted_at = now
            if (view := client.view()) is not None:
                client.predicted_s = iteration_s(view)
            label = device_label(name)
            TURNS.labels(label).inc()
            TURN_WAIT.labels(label).observe(now - client.asked_at)
            if client.wants is not None and client.wants.deadline < now:
                LATE_TURNS.labels(label).inc()
            client.wants = None


class TurnClient:
    """A TE's side: ``async with client.turn(claim, device, requests):`` around each
    engine iteration; ``check`` before it takes a request (shadow validation on the
    device); ``serving`` when what it serves changes. Without an arbiter, or once talking to
    it failed, every turn is granted at once and every request admitted."""

    def __init__(self, path: str, name: str) -> None:
        self._path, self._name = path, name
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._go: asyncio.Future[None] | None = None
        self._verdicts: dict[int, asyncio.Future[Verdict]] = {}
        self._asked = 0
        self._instance = "none"
        self._off = not path
        # Its KV pool under the device's budget: what it holds (as it last said), the most the
        # arbiter lets it hold now, the size it asked for, and whether it was told to shrink.
        self._held: int | None = None
        self._room = math.inf
        self._needs: int | None = None
        self._squeezed = False
        self._device_free = math.inf  # what the device's books have not given any pool
        self._holds = 0  # "hold"s said on this connection: a "room" echoes the last it read
        self._room_changed = asyncio.Event()
        self._connecting = asyncio.Lock()
        self.on_squeeze: Callable[[], None] | None = None  # told to shrink (on the loop)
        # Told to hand its requests back and unload: a neighbour's grow needs its KV. With
        # where each was validated: request key -> TE id (``kv_sizing.Preemption.moves``).
        self.on_preempt: Callable[[dict[str, str]], None] | None = None

    @property
    def active(self) -> bool:
        return not self._off

    @property
    def _talking(self) -> bool:
        return self._writer is not None and self._reading is not None and not self._reading.done()

    async def _connected(self, device: str) -> asyncio.StreamWriter:
        async with self._connecting:  # one connection, whoever asks first
            if self._writer is None:
                reader, writer = await asyncio.open_unix_connection(self._path)
                writer.write(f"hello {self._name} {device}\n".encode())
                writer.write(f"instance {self._instance}\n".encode())
                if self._held is not None:  # a new connection: the arbiter knows nothing of it
                    self._holds += 1
                    writer.write(f"hold {self._held} {self._holds}\n".encode())
                    self._room, self._needs = self._held, None
                self._writer = writer
                self._reading = asyncio.create_task(self._read(reader))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while line := await reader.readline():
                word, _, arg = line.decode().strip().partition(" ")
                if word == "go" and self._go is not None and not self._go.done():
                    self._go.set_result(None)
                elif word == "room":
                    room, _, number = arg.partition(" ")
                    # A room granted before the arbiter read its last hold is void: the hold
                    # reset its books (what it granted then may go to another TE).
                    if self._needs is not None and int(number or 0) == self._holds:
                        self._room = float(room)
                        self._room_changed.set()
                elif word == "free":
                    self._device_free = float(arg)
                elif word == "squeeze":
                    self._squeezed = True
                    if self.on_squeeze is not None:
                        self.on_squeeze()
                elif word == "preempt" and self.on_preempt is not None:
                    self.on_preempt(msgspec.json.decode(arg or "{}", type=dict[str, str]))
                elif word == "verdict":
                    ask, _, body = arg.partition(" ")
                    future = self._verdicts.pop(int(ask), None)
                    if future is not None and not future.done():
                        future.set_result(msgspec.json.decode(body, type=Verdict))
        except (OSError, ValueError, msgspec.DecodeError):
            pass
        self._room_changed.set()  # a reservation waiting gives up: no books any more
        gone = ConnectionError("the device arbiter went away")
        if self._go is not None and not self._go.done():
            self._go.set_exception(gone)
        for future in self._verdicts.values():
            if not future.done():
                future.set_exception(gone)

    def serving(self, instance: Instance | None) -> None:
        """What this TE serves now (None: nothing, or no performance model)."""
        self._instance = "none" if instance is None else msgspec.json.encode(instance).decode()
        if self._writer is not None:
            self._send(f"instance {self._instance}\n")

    async def announce(self, device: str) -> None:
        """Connect now, not at its first turn: what it serves goes with the hello, so that
        other pools' plays see an instance before its first request."""
        if self._off:
            return
        try:
            await self._connected(device)
        except (OSError, ConnectionError) as e:
            self._give_up(e)

    def requests(self, requests: Iterable[RequestView]) -> None:
        """The requests it holds, when they change outside an iteration (it went idle)."""
        if self._writer is not None:
            self._send(f"requests {encode_requests(requests)}\n")

    @property
    def kv_room(self) -> float:
        """The bytes of KV this TE may hold now (inf: no arbiter, or it never said)."""
        return math.inf if self._off or self._held is None else self._room

    @property
    def kv_device_free(self) -> float:
        """The bytes of KV the device's books have not given any pool (inf: no arbiter, no
        budget, or it never said): what this TE's pool could still grow into."""
        return math.inf if self._off else self._device_free

    def kv_hold(self, nbytes: int) -> None:
        """Its KV pool holds ``nbytes`` now (after a resize, or at first)."""
        self._held, self._room, self._needs = nbytes, nbytes, None
        if self._writer is not None:
            self._holds += 1
            self._send(f"hold {nbytes} {self._holds}\n")

    def kv_need(self, nbytes: int, deadline: float) -> None:
        """It wants its KV pool to hold ``nbytes``, for a request due at ``deadline``."""
        if self._writer is None or nbytes == self._needs or self._held is None:
            return
        self._needs = nbytes
        urgency = deadline if math.isfinite(deadline) else 1e18
        self._send(f"need {nbytes} {urgency!r}\n")

    def kv_enough(self) -> None:
        """Its pool no longer wants to grow (its demand fell): a grow it asked for and still
        waits for is withdrawn (saying what it holds), so that it does not hold up the
        device's other grows, none of which overtakes it."""
        if self._needs is not None and self._held is not None:
            self.kv_hold(self._held)

    async def kv_reserve(self, nbytes: int, device: str, deadline: float, wait_s: float) -> bool:
        """Room for ``nbytes`` of KV before a model loads (it holds none yet): asked as a
        grow from nothing, the device's other TEs told to shrink while it waits. True once
        granted (or with no arbiter to ask); False after ``wait_s`` without it (the ask is
        withdrawn). The load's first ``kv_hold`` turns the reservation into what it holds."""
        if self._off:
            return True
        try:
            await self._connected(device)
        except (OSError, ConnectionError) as e:
            self._give_up(e)
            return True
        self.kv_hold(0)
        self._room = 0
        self.kv_need(nbytes, deadline)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while self._room < nbytes and self._talking:
                    self._room_changed.clear()
                    await self._room_changed.wait()
        if not self._talking:  # the arbiter went away: no books to keep
            return True
        if self._room >= nbytes:
            return True
        self.kv_hold(0)  # withdrawn
        return False

    def take_squeeze(self) -> bool:
        """Whether it was told to shrink since it last asked."""
        squeezed, self._squeezed = self._squeezed, False
        return squeezed

    async def check(self, new: RequestView, device: str) -> Verdict:
        """Whether ``new`` may join this TE (admitted when there is no arbiter)."""
        if self._off:
            return Verdict(ok=True)
        try:
            writer = await self._connected(device)
            self._asked += 1
            future = self._verdicts[self._asked] = asyncio.get_running_loop().create_future()
            writer.write(f"check {self._asked} {encode_requests([new])}\n".encode())
            return await asyncio.wait_for(future, 5)
        except (OSError, ConnectionError, TimeoutError, ValueError) as e:
            self._give_up(e)
            return Verdict(ok=True)

    @contextlib.asynccontextmanager
    async def turn(
        self,
        claim: Urgency | float,
        device: str,
        requests: Iterable[RequestView] | None = None,
    ) -> AsyncIterator[None]:
        """``claim``: its most urgent request's (``shared.headroom.urgency``; a bare
        deadline: one that does not yield); ``device``: the engine's (the turns are that
        device's; the first names it); ``requests``: what it holds, for the device's shadow
        validations."""
        held = await self._acquire(
            claim if isinstance(claim, Urgency) else Urgency(False, claim), device, requests
        )
        try:
            yield
        finally:
            if held and self._writer is not None:
                self._send("done\n")

    async def _acquire(
        self, claim: Urgency, device: str, requests: Iterable[RequestView] | None
    ) -> bool:
        if self._off:
            return False
        try:
            writer = await self._connected(device)
            d = claim.deadline if math.isfinite(claim.deadline) else 1e18
            said = " yield" if claim.yields else ""
            body = f" {encode_requests(requests)}" if requests is not None else ""
            self._go = asyncio.get_running_loop().create_future()
            writer.write(f"want {d!r}{said}{body}\n".encode())
            await self._go
            return True
        except asyncio.CancelledError:  # a "go" may be on its way: start afresh next time
            self._drop()
            raise
        except (OSError, ConnectionError, ValueError) as e:
            self._give_up(e)
            return False

    def _send(self, line: str) -> None:
        assert self._writer is not None
        try:
            self._writer.write(line.encode())
        except (OSError, RuntimeError):
            self._drop()

    def _give_up(self, e: BaseException) -> None:
        log.warning("device arbiter unreachable: iterations run unarbitrated", error=str(e))
        self._drop()
        self._off = True

    def _drop(self) -> None:
        """The connection closed (the arbiter gives back whatever turn it held)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None

    def close(self) -> None:
        self._drop()
        self._off = True


def serves_arbiter(te: TaskExecutorSettings, cores: int) -> bool:
    """Whether a pool serves its TEs an arbiter: one whose TEs take turns
    (``shares_device``), or one that only observes, for shadow validation (a TE's own
    ``check``s) and KV preemption (the snapshots other pools' arbiters play)."""
    return shares_device(te, cores) or te.shadow_admission or te.kv_preemption


def shares_device(te: TaskExecutorSettings, cores: int) -> bool:
    """Whether a pool's TEs contend for one device, so that taking turns pays: a GPU (or
    ``auto``, which may be one), or CPU TEs whose threads together outnumber the cores (0
    threads: torch's default, every core)."""
    if not te.device_turns or te.pool_size < 2:
        return False
    if te.device != "cpu":
        return True
    return (te.torch_threads or cores) * te.pool_size > cores

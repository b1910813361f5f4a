"""The KV data plane (services/task_executor/kv_transport): a real server and real pulls over
loopback TCP and /dev/shm, the KV checked byte for byte, and every way a lease ends."""

from __future__ import annotations

import asyncio
import itertools
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from services.task_executor.kv_transport import connections as connections_module
from services.task_executor.kv_transport import server as server_module
from services.task_executor.kv_transport import shm, wire
from services.task_executor.kv_transport.client import Pulled, TransferFailed, pull, reject
from services.task_executor.kv_transport.connections import Connections, default_connections
from services.task_executor.kv_transport.mapped import MappedArenas
from services.task_executor.kv_transport.outbox import Outbox, _cover
from services.task_executor.kv_transport.pool import ArenaPool
from services.task_executor.kv_transport.server import KvServer

LAYERS, HEADS, HEAD_DIM, TOKENS = 4, 2, 16, 200
TRANSPORTS = ["tcp", "shm"]


def _ours() -> set[str]:
    return {
        p.name
        for p in shm.SHM_DIR.iterdir()
        if p.name.startswith((shm.PROBE_PREFIX, shm.ARENA_PREFIX))
    }


POOL: ArenaPool | None = None  # the current test's arena pool (the prefill side's)


@pytest.fixture(autouse=True)
def pool() -> Iterator[ArenaPool]:
    """The test's arena pool; once it is closed, no file of ours may be left in /dev/shm."""
    global POOL
    before = _ours()
    POOL = ArenaPool()
    yield POOL
    POOL.close()
    deadline = time.monotonic() + 1.0
    while _ours() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _ours() - before == set()


class Ends:
    """on_end's calls, and a way to wait for one."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.event = asyncio.Event()

    def __call__(self, key: str, reason: str) -> None:
        assert key not in self.of, f"on_end called twice for {key}"
        self.calls.append((key, reason))
        self.event.set()

    @property
    def of(self) -> dict[str, str]:
        return dict(self.calls)

    async def wait(self, key: str, timeout: float = 2.0) -> str:
        async with asyncio.timeout(timeout):
            while key not in self.of:
                self.event.clear()
                await self.event.wait()
        return self.of[key]


@pytest.fixture
async def ends() -> Ends:
    return Ends()


@pytest.fixture
async def server(ends: Ends) -> AsyncIterator[KvServer]:
    srv = KvServer(on_end=ends, grace_s=0.3)
    await srv.start()
    yield srv
    await srv.close()


def source(dtype: torch.dtype = torch.bfloat16, tokens: int = TOKENS) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens)
    return torch.randn(LAYERS, 2, tokens, HEADS, HEAD_DIM, generator=g).to(dtype)


def outbox(key: str, src: torch.Tensor, lease_s: float = 1.0) -> Outbox:
    return Outbox(
        key,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype=src.dtype,
        num_prompt_tokens=src.shape[2],
        lease_s=lease_s,
        arenas=POOL,
    )


def write(box: Outbox, src: torch.Tensor, chunk: int = 64, shuffle: bool = False) -> None:
    writes = [(layer, s) for s in range(0, src.shape[2], chunk) for layer in range(LAYERS)]
    if shuffle:
        random.Random(7).shuffle(writes)
    for layer, s in writes:
        box.layer(
            layer, s, src[layer, 0, s : s + chunk].clone(), src[layer, 1, s : s + chunk].clone()
        )


def finish(box: Outbox, src: torch.Tensor) -> None:
    n = src.shape[2]
    box.done([*range(n), 7], n, None)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    )


def row_bytes(dtype: torch.dtype) -> int:
    return HEADS * HEAD_DIM * dtype.itemsize


async def pull_from(
    server: KvServer | str, key: str, transport: str = "shm", **kw: float | int
) -> Pulled:
    args = {"skip_tokens": 0, "deadline_s": 5.0, "renew_s": 0.1} | kw
    address = server if isinstance(server, str) else server.address
    return await pull(address, key, shm=transport == "shm", **args)  # type: ignore[arg-type]


# --- the bytes ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_pull_holds_the_source_kv_byte_for_byte(server, ends, transport, dtype):
    src = source(dtype)
    box = outbox("a", src)
    server.offer(box)
    write(box, src)
    finish(box, src)
    p = await pull_from(server, "a", transport)
    assert p.transport == transport
    assert same_bytes(p.kv, src)
    assert p.dtype == dtype and p.first_token == 0
    assert (p.num_prompt_tokens, p.num_computed_tokens) == (TOKENS, TOKENS)
    assert p.token_ids == [*range(TOKENS), 7] and p.finish_reason is None
    assert p.nbytes == LAYERS * 2 * TOKENS * row_bytes(dtype) and p.seconds > 0
    del p  # (in place, the lease is held until the result is gone)
    assert await ends.wait("a") == "released"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_skipped_tokens_are_not_sent(server, ends, transport):
    src = source()
    box = outbox("s", src)
    server.offer(box)
    write(box, src, chunk=50)  # 37 falls inside the first chunk: the rest of it is sent
    box.done([*range(TOKENS), 1], TOKENS, "stop")
    p = await pull_from(server, "s", transport, skip_tokens=37)
    assert p.first_token == 37 and p.finish_reason == "stop"
    assert p.nbytes == LAYERS * 2 * (TOKENS - 37) * row_bytes(torch.bfloat16)
    assert same_bytes(p.kv, src[:, :, 37:])
    del p
    assert await ends.wait("s") == "released"


async def test_skipping_every_computed_token_sends_nothing(server, ends):
    src = source()
    box = outbox("all", src)
    server.offer(box)
    write(box, src)
    box.done([*range(TOKENS), 1], 150, None)
    p = await pull_from(server, "all", "shm", skip_tokens=TOKENS)
    assert p.nbytes == 0 and p.kv.shape == (LAYERS, 2, 0, HEADS, HEAD_DIM)
    assert (p.first_token, p.num_computed_tokens) == (150, 150)
    assert p.transport == "tcp"  # nothing to read in place: released at once
    assert await ends.wait("all") == "released"


@pytest.mark.parametrize("waiting", [True, False])
@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_prefill_that_computed_part_of_the_prompt_sends_that_part(
    server, ends, transport, waiting
):
    """``Done`` says how many tokens were computed: the result holds those, whether the
    puller waited for it (``waiting``) or came once the prefill had finished."""
    src = source()
    box = outbox("part", src)
    server.offer(box)
    write(box, src)
    puller = asyncio.create_task(pull_from(server, "part", transport, skip_tokens=20))
    if waiting:
        await asyncio.sleep(0.1)
    box.done([*range(TOKENS), 1], 150, "length")
    p = await puller
    del puller  # (a task holds its result)
    assert (p.first_token, p.num_computed_tokens, p.transport) == (20, 150, transport)
    assert same_bytes(p.kv, src[:, :, 20:150])
    del p
    assert await ends.wait("part") == "released"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_layers_written_from_another_thread_while_the_puller_waits(server, ends, transport):
    src = source()
    box = outbox("o", src)
    server.offer(box)
    puller = asyncio.create_task(pull_from(server, "o", transport))
    await asyncio.sleep(0.1)  # the puller is connected and waiting

    def engine() -> None:  # out of order, a chunk at a time, one range computed twice
        write(box, src, chunk=32, shuffle=True)
        box.layer(2, 40, src[2, 0, 40:90].clone(), src[2, 1, 40:90].clone())

    thread = threading.Thread(target=engine)
    thread.start()
    await asyncio.to_thread(thread.join)
    finish(box, src)
    p = await puller
    del puller  # (a task holds its result)
    assert same_bytes(p.kv, src)
    # over TCP a range sent twice counts twice; in place the KV is read once
    twice = 50 if transport == "tcp" else 0
    assert p.nbytes == (LAYERS * TOKENS + twice) * 2 * row_bytes(torch.bfloat16)
    del p
    assert await ends.wait("o") == "released"


def test_the_outbox_copies_what_it_is_given():
    src = source()
    box = outbox("c", src)
    k, v = src[1, 0, :10].clone(), src[1, 1, :10].clone()
    box.layer(1, 0, k, v)
    k.zero_()  # the caller's tensor is its own again
    (piece,) = box.take()
    k_rows = torch.frombuffer(piece.k_bytes, dtype=torch.uint8)
    assert same_bytes(k_rows.view(src.dtype).view(10, HEADS, HEAD_DIM), src[1, 0, :10])
    assert box.shared_path is not None
    box.discard()
    assert box.shared_path is None
    box.layer(1, 10, k, v)  # after the lease: nothing kept
    assert box.take() == []


def test_written_ranges_are_kept_as_disjoint_intervals():
    rng = random.Random(0)
    for _ in range(500):
        intervals: list[list[int]] = []
        cells: set[int] = set()
        for _ in range(rng.randint(0, 8)):
            a = rng.randint(0, 30)
            b = a + rng.randint(1, 6)
            _cover(intervals, a, b)
            cells |= set(range(a, b))
        assert {t for a, b in intervals for t in range(a, b)} == cells
        assert all(x[1] < y[0] for x, y in itertools.pairwise(intervals))


async def test_an_incomplete_kv_fails_the_pull(server, ends):
    src = source()
    box = outbox("gap", src)
    server.offer(box)
    write(box, src[:, :, :100])
    box.layer(3, 100, src[3, 0, 100:].clone(), src[3, 1, 100:].clone())
    finish(box, src)
    with pytest.raises(TransferFailed, match=r"layer 0 lacks tokens \[100, 200\)"):
        await pull_from(server, "gap", "tcp")
    assert (await ends.wait("gap")).startswith("failed: layer 0")


# --- finding the key ------------------------------------------------------------------------


async def test_a_puller_before_the_offer_waits_for_it(ends):
    srv = KvServer(on_end=ends, grace_s=2.0)
    await srv.start()
    try:
        src = source()
        puller = asyncio.create_task(pull_from(srv.address, "late"))
        await asyncio.sleep(0.3)
        box = outbox("late", src)
        srv.offer(box)
        write(box, src)
        finish(box, src)
        assert same_bytes((await puller).kv, src)
    finally:
        await srv.close()


async def test_an_unknown_key_fails_after_the_grace(server):
    t = time.monotonic()
    with pytest.raises(TransferFailed, match="no KV under key"):
        await pull_from(server, "nobody", "tcp")
    assert 0.25 < time.monotonic() - t < 1.5


async def test_a_second_puller_is_refused(server, ends):
    src = source()
    box = outbox("two", src)
    server.offer(box)
    first = asyncio.create_task(pull_from(server, "two", "shm"))
    await asyncio.sleep(0.1)
    with pytest.raises(TransferFailed, match="already being pulled"):
        await pull_from(server, "two", "tcp")
    write(box, src)
    finish(box, src)
    assert same_bytes((await first).kv, src)
    del first  # (a task holds its result)
    assert await ends.wait("two") == "released"
    with pytest.raises(TransferFailed, match="released"):  # and once it ended, too
        await pull_from(server, "two", "tcp")


async def test_a_connection_that_cannot_be_made_fails(server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with pytest.raises(TransferFailed, match="cannot connect"):
            await pull(f"127.0.0.1:{port}", "x", skip_tokens=0, deadline_s=2, renew_s=1)


# --- leases ---------------------------------------------------------------------------------


async def test_an_offer_nobody_pulls_expires(server, ends, pool):
    t = time.monotonic()
    server.offer(outbox("idle", source(), lease_s=0.3))
    assert await ends.wait("idle") == "expired"
    assert 0.25 < time.monotonic() - t < 1.5
    assert pool.idle_bytes > 0  # nobody read its arena: it is written again
    with pytest.raises(TransferFailed, match="expired"):
        await pull_from(server, "idle", "tcp")


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_renewals_keep_a_slow_prefill_alive(server, ends, transport):
    src = source()
    box = outbox("slow", src, lease_s=0.3)
    server.offer(box)
    puller = asyncio.create_task(pull_from(server, "slow", transport, renew_s=0.1))
    await asyncio.sleep(1.0)  # more than three leases
    assert "slow" not in ends.of
    write(box, src)
    finish(box, src)
    assert same_bytes((await puller).kv, src)
    del puller  # (a task holds its result)
    assert await ends.wait("slow") == "released"


async def test_a_puller_that_does_not_renew_loses_the_lease(server, ends):
    server.offer(outbox("lapse", source(), lease_s=0.3))
    with pytest.raises(TransferFailed, match="lease expired"):
        await pull_from(server, "lapse", "tcp", renew_s=5.0)
    assert ends.of["lapse"] == "expired"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_puller_cancelled_mid_transfer_ends_the_lease_at_once(server, ends, transport):
    src = source()
    box = outbox("gone", src, lease_s=5.0)
    server.offer(box)
    write(box, src[:, :, :128])  # part of it sent, no done
    puller = asyncio.create_task(pull_from(server, "gone", transport))
    await asyncio.sleep(0.2)
    puller.cancel()
    t = time.monotonic()
    assert await ends.wait("gone") == "disconnected"
    assert time.monotonic() - t < 1.0  # the lease had 5 s left
    write(box, src[:, :, 128:])  # the engine still writing: dropped
    with pytest.raises(asyncio.CancelledError):
        await puller


async def test_a_connection_closed_mid_transfer_ends_the_lease(server, ends):
    src = source()
    box = outbox("cut", src, lease_s=5.0)
    server.offer(box)
    write(box, src)
    reader, writer = await asyncio.open_connection(*wire.parse_address(server.address))
    writer.write(wire.frame_head(wire.Pull("cut", 0)))
    await reader.read(100)  # Meta and the start of the KV
    writer.close()
    assert await ends.wait("cut") == "disconnected"


async def test_reject_ends_the_lease(server, ends):
    server.offer(outbox("no", source()))
    await reject(server.address, "no", "decode pool is full")
    assert ends.of["no"] == "rejected: decode pool is full"
    with pytest.raises(TransferFailed, match="no KV under key"):
        await reject(server.address, "never", "whatever")


async def test_withdraw_fails_a_waiting_puller(server, ends):
    server.offer(outbox("w", source()))
    puller = asyncio.create_task(pull_from(server, "w", "shm"))
    await asyncio.sleep(0.1)
    server.withdraw("w", "task cancelled")
    with pytest.raises(TransferFailed, match="withdrawn: task cancelled"):
        await puller
    assert ends.of["w"] == "task cancelled"
    server.withdraw("w", "again")  # a lease ends once
    assert ends.calls == [("w", "task cancelled")]


@pytest.mark.parametrize("before_pull", [False, True])
async def test_a_failed_prefill_fails_the_pull(server, ends, before_pull):
    src = source()
    box = outbox("f", src)
    server.offer(box)
    write(box, src[:, :, :64])
    if before_pull:
        box.fail("out of memory")
        assert await ends.wait("f") == "failed: out of memory"
    else:
        asyncio.get_running_loop().call_later(0.1, box.fail, "out of memory")
    with pytest.raises(TransferFailed, match="out of memory"):
        await pull_from(server, "f", "tcp")
    assert ends.of["f"] == "failed: out of memory"


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_stalled_prefill_fails_the_pull_at_its_deadline(server, ends, transport):
    src = source()
    box = outbox("stall", src, lease_s=5.0)
    server.offer(box)
    write(box, src)  # everything but done
    t = time.monotonic()
    with pytest.raises(TransferFailed, match=r"within 0\.5 s"):
        await pull_from(server, "stall", transport, deadline_s=0.5)
    assert 0.45 < time.monotonic() - t < 2.0  # the lease had 5 s
    assert await ends.wait("stall") == "disconnected"


async def test_closing_the_server_ends_every_lease(ends):
    srv = KvServer(on_end=ends)
    await srv.start()
    srv.offer(outbox("c1", source()))
    srv.offer(outbox("c2", source()))
    puller = asyncio.create_task(pull_from(srv.address, "c1"))
    await asyncio.sleep(0.1)
    await srv.close()
    assert ends.of == {"c1": "closed", "c2": "closed"}
    with pytest.raises(TransferFailed, match="shutting down"):
        await puller


# --- shared-memory arenas -------------------------------------------------------------------


async def test_a_kv_read_in_place_keeps_its_lease_until_its_result_is_gone(server, ends, pool):
    src = source()
    box = outbox("held", src, lease_s=0.3)
    server.offer(box)
    write(box, src)
    finish(box, src)
    p = await pull_from(server, "held", renew_s=0.1, skip_tokens=10)
    assert p.transport == "shm" and not p.kv.is_contiguous()  # the arena itself, no copy
    kept = p.kv[1]
    del p
    await asyncio.sleep(0.6)  # two leases: renewed while a view of the result lives
    assert "held" not in ends.of and pool.idle_bytes == 0
    assert same_bytes(kept, src[1, :, 10:])
    del kept
    assert await ends.wait("held") == "released"
    assert pool.idle_bytes > 0  # back in the pool, to be written again


async def test_an_arena_is_written_again_only_after_a_release(server, ends, pool):
    src = source()

    async def one(key: str) -> Pulled:
        await offered(server, key, src)
        p = await pull_from(server, key)
        assert same_bytes(p.kv, src)
        return p

    kept = (await one("r1")).kv[1]  # a view of the result holds the lease, and the arena
    await one("r2")  # so this prompt needs another arena
    assert (pool.created, pool.reused) == (2, 0)
    assert await ends.wait("r2") == "released"
    del kept
    assert await ends.wait("r1") == "released"
    await one("r3")
    assert (pool.created, pool.reused) == (2, 1)


async def test_an_arena_whose_lease_ended_unreleased_is_dropped_and_reads_stay_intact(
    server, ends, pool
):
    """A puller that holds its result past its deadline stops renewing; the lease expires
    and the prefill side drops the arena instead of writing it again, so the result still
    reads the prompt's KV while other prompts come."""
    src, other = source(), source(tokens=TOKENS + 1)[:, :, :TOKENS]
    box = outbox("late", src, lease_s=0.2)
    server.offer(box)
    write(box, src)
    finish(box, src)
    p = await pull_from(server, "late", deadline_s=0.1, renew_s=0.05)
    path = box.shared_path
    assert path is not None
    assert await ends.wait("late") == "expired"
    assert pool.idle_bytes == 0 and not shm.SHM_DIR.joinpath(path).exists()
    for key in ("o1", "o2"):
        await offered(server, key, other)
        assert same_bytes((await pull_from(server, key)).kv, other)
        assert await ends.wait(key) == "released"
    assert (pool.created, pool.reused) == (2, 1)  # the dropped arena was not one of them
    assert same_bytes(p.kv, src)


async def test_a_pool_keeping_no_idle_bytes_drops_each_arena_once_released(server, ends):
    """``MESHSERVE_KV_ARENA_POOL_BYTES=0``: every prompt gets a new arena, and none stays
    in /dev/shm once its puller released it."""
    global POOL
    before = _ours()
    saved, POOL = POOL, ArenaPool(idle_bytes=0)
    try:
        src = source()
        for key in ("n1", "n2"):
            await offered(server, key, src)
            p = await pull_from(server, key)
            assert p.transport == "shm" and same_bytes(p.kv, src)
            del p
            assert await ends.wait(key) == "released"
        assert (POOL.created, POOL.reused) == (2, 0)
        assert POOL.idle_bytes == 0 and _ours() - before == set()
    finally:
        POOL.close()
        POOL = saved


async def test_an_outbox_without_room_in_dev_shm_goes_over_tcp(server, ends, pool, monkeypatch):
    def full(nbytes: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pool, "lend", full)
    src = source()
    box = outbox("heap", src)
    assert box.shared_path is None
    server.offer(box)
    write(box, src)
    finish(box, src)
    p = await pull_from(server, "heap", "shm")
    assert p.transport == "tcp" and same_bytes(p.kv, src)
    assert await ends.wait("heap") == "released"


def test_sweep_removes_only_what_dead_processes_left(monkeypatch):
    monkeypatch.setattr(shm, "SWEEP_MIN_AGE_S", -1.0)
    live = ArenaPool()
    arena = live.lend(100)
    orphan = shm.new_name(shm.ARENA_PREFIX)
    orphan.write_bytes(b"left by a process that died")
    try:
        shm.sweep()
        assert not orphan.exists()
        assert arena.path.exists()
    finally:
        live.give_back(arena, reuse=False)
        live.close()
        shm.remove(orphan)


async def test_the_puller_drops_its_mapping_of_an_arena_its_owner_unlinked(pool):
    mapped = MappedArenas()
    arena = pool.lend(4096)
    assert arena.tensor is not None
    arena.tensor[:3].copy_(torch.tensor([1, 2, 3], dtype=torch.uint8))
    view = mapped.get(str(arena.path), 4096)
    assert bytes(view[:3]) == b"\x01\x02\x03" and not view.flags.writeable
    assert mapped.mapped_bytes == arena.path.stat().st_size
    pool.give_back(arena, reuse=False)
    mapped.prune()
    assert mapped.mapped_bytes == 0
    assert bytes(view[:3]) == b"\x01\x02\x03"  # a view held keeps the pages
    with pytest.raises(OSError, match="not a KV arena"):
        mapped.get("/etc/passwd", 10)
    mapped.clear()


async def test_a_puller_that_does_not_share_dev_shm_gets_tcp(server, ends, monkeypatch):
    monkeypatch.setattr(shm, "probe_matches", lambda path, data: False)  # another /dev/shm
    src = source()
    await offered(server, "far", src)
    p = await pull_from(server, "far", "shm")
    assert p.transport == "tcp" and same_bytes(p.kv, src)
    assert await ends.wait("far") == "released"


# --- kept connections -----------------------------------------------------------------------


async def offered(server: KvServer, key: str, src: torch.Tensor) -> None:
    box = outbox(key, src)
    server.offer(box)
    write(box, src)
    finish(box, src)


async def settled(conns: Connections, idle: int) -> None:
    """Until ``conns`` holds ``idle`` idle connections (the server's Ok comes after the pull
    returned)."""
    async with asyncio.timeout(2.0):
        while conns.idle != idle:  # noqa: ASYNC110 (nothing to wait on: it is a count)
            await asyncio.sleep(0.01)


async def test_pulls_in_a_row_share_one_connection_and_one_probe(server, ends, monkeypatch):
    probes = []
    make_probe = shm.make_probe
    monkeypatch.setattr(shm, "make_probe", lambda: probes.append(1) or make_probe())
    conns = default_connections()
    src = source()
    for i, transport in enumerate(["shm", "shm", "tcp", "shm"]):
        await offered(server, f"k{i}", src)
        p = await pull_from(server, f"k{i}", transport)
        assert p.transport == transport and same_bytes(p.kv, src)
        del p
        assert await ends.wait(f"k{i}") == "released"
        await settled(conns, 1)
    assert (conns.opened, conns.reused) == (1, 3)
    assert len(probes) == 1  # the first pull's probe holds for the connection


async def test_a_failed_pull_closes_its_connection(server, ends):
    conns = default_connections()
    src = source()
    await offered(server, "ok", src)
    await pull_from(server, "ok")
    await settled(conns, 1)
    with pytest.raises(TransferFailed, match="no KV under key"):
        await pull_from(server, "nothing-here")  # on the kept connection: it is not kept
    assert conns.idle == 0
    await offered(server, "ok2", src)
    assert same_bytes((await pull_from(server, "ok2")).kv, src)
    assert (conns.opened, conns.reused) == (2, 1)


@pytest.mark.parametrize("seen", [True, False])
async def test_a_kept_connection_the_server_closed_is_replaced(server, ends, monkeypatch, seen):
    """The server drops idle connections after IDLE_S: the next pull sees it (``seen``) or
    fails on it before the server read anything, and pulls over a new one either way."""
    monkeypatch.setattr(server_module, "IDLE_S", 0.1)
    if not seen:
        monkeypatch.setattr(connections_module, "_quiet", lambda sock: True)
    conns = default_connections()
    src = source()
    await offered(server, "a", src)
    await pull_from(server, "a")
    await settled(conns, 1)
    await asyncio.sleep(0.3)  # the server closed its end
    await offered(server, "b", src)
    assert same_bytes((await pull_from(server, "b")).kv, src)
    assert await ends.wait("b") == "released"
    assert conns.opened == 2


async def test_closing_the_server_does_not_wait_for_kept_connections(ends):
    srv = KvServer(on_end=ends)
    await srv.start()
    src = source()
    await offered(srv, "x", src)
    await pull_from(srv, "x")
    await settled(default_connections(), 1)
    t = time.monotonic()
    await srv.close()
    assert time.monotonic() - t < 1.0

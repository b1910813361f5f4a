"""The broadcast transport: a schedule played between nodes over loopback TCP (a thread per
node here, a process per node in ``bench/multicast.py``) leaves every receiver with exactly
the source's bytes, a block that fails its checksum stops the broadcast with an error that
names it, and no node waits forever."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Sequence

import pytest
import xxhash

from services.task_executor.weight_cache.multicast import Transfer, binomial_pipeline, fan_out
from services.task_executor.weight_cache.relay import (
    BlockStore,
    NodeStats,
    RelayError,
    address_of,
    block_count,
    listen,
    run_node,
)

Schedule = Callable[[int, int], list[list[Transfer]]]


def _broadcast(
    receivers: int,
    schedule: Sequence[Sequence[Transfer]],
    source: bytes,
    block_bytes: int,
    *,
    corrupt: Collection[int] = (),
    timeout: float = 5.0,
) -> tuple[list[BlockStore], list[NodeStats | None], list[BaseException | None]]:
    """Every node on a thread of its own; each node's store, stats and failure."""
    listeners = [listen() for _ in range(receivers + 1)]
    addresses = [address_of(s) for s in listeners]
    stores = [BlockStore(source, block_bytes, full=True)] + [
        BlockStore(bytearray(len(source)), block_bytes) for _ in range(receivers)
    ]
    stats: list[NodeStats | None] = [None] * (receivers + 1)
    errors: list[BaseException | None] = [None] * (receivers + 1)

    def node(k: int) -> None:
        try:
            stats[k] = run_node(
                k, schedule, addresses, stores[k], listener=listeners[k], timeout=timeout,
                corrupt=corrupt if k == 0 else (),
            )  # fmt: skip
        except BaseException as e:
            errors[k] = e

    threads = [threading.Thread(target=node, args=(k,)) for k in range(receivers + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * timeout)
        assert not t.is_alive(), "a node never finished"
    for s in listeners:
        s.close()
    return stores, stats, errors


@pytest.mark.parametrize("make", [binomial_pipeline, fan_out], ids=["pipeline", "fan_out"])
@pytest.mark.parametrize("receivers", [1, 3, 4, 7])
def test_every_receiver_ends_with_the_source_bytes(receivers: int, make: Schedule) -> None:
    block_bytes = 64 << 10
    source = os.urandom(5 * block_bytes + 1234)  # the last block is shorter
    blocks = block_count(len(source), block_bytes)
    assert blocks == 6
    stores, stats, errors = _broadcast(receivers, make(receivers, blocks), source, block_bytes)
    assert errors == [None] * (receivers + 1)
    for store in stores[1:]:
        assert store.holds_all() and bytes(store.view) == source
    done = [s for s in stats if s is not None]
    assert len(done) == receivers + 1
    assert sum(s.bytes_sent for s in done) == receivers * len(source)
    assert all(s.bytes_received == len(source) for s in done[1:])
    assert done[0].bytes_received == 0 and done[0].first_byte is None
    for s in done[1:]:
        assert s.first_byte is not None and s.started <= s.first_byte <= s.held_all <= s.finished
    if make is fan_out:  # the source sent every copy itself
        assert done[0].bytes_sent == receivers * len(source)


def test_receivers_forward_while_they_receive() -> None:
    """In the pipeline each node sends what the schedule gives it: every receiver forwards,
    and the source sends about one copy, not N."""
    block_bytes = 4096
    source = os.urandom(8 * block_bytes)
    schedule = binomial_pipeline(3, 8)
    stores, stats, errors = _broadcast(3, schedule, source, block_bytes)
    assert errors == [None] * 4
    done = [s for s in stats if s is not None]
    for s in done:
        assert s.blocks_sent == sum(t.sender == s.node for step in schedule for t in step) > 0
    assert done[0].blocks_sent < 2 * 8 and sum(s.blocks_sent for s in done) == 3 * 8
    assert all(bytes(s.view) == source for s in stores[1:])


def test_a_block_that_fails_its_checksum_stops_the_broadcast_with_a_clear_error() -> None:
    block_bytes = 4096
    source = os.urandom(6 * block_bytes)
    schedule = binomial_pipeline(3, 6)
    (victim,) = [t.receiver for step in schedule for t in step if t.sender == 0 and t.block == 2]
    t0 = time.monotonic()
    _, _, errors = _broadcast(3, schedule, source, block_bytes, corrupt={2}, timeout=3.0)
    assert time.monotonic() - t0 < 10
    error = errors[victim]
    assert isinstance(error, RelayError)
    assert f"node {victim}: block 2 from node 0 failed its checksum" in str(error)
    # The others stop too (the victim's connections close), each with a RelayError.
    assert all(e is None or isinstance(e, RelayError) for e in errors)


def test_a_forwarder_keeps_the_digest_it_checked() -> None:
    """A receiver's digest of a block is the one it arrived with (no second hash)."""
    data = os.urandom(10_000)
    store = BlockStore(bytearray(len(data)), 4096)
    assert store.blocks == 3 and not store.holds(0)
    store.block(0)[:] = data[:4096]
    store.put(0, b"12345678")
    assert store.holds(0) and store.digest(0) == b"12345678"
    full = BlockStore(data, 4096, full=True)
    assert full.holds_all() and full.digest(2) == xxhash.xxh3_64_digest(data[8192:])


def test_a_receiver_needs_a_writable_buffer_and_the_schedule_is_checked() -> None:
    with pytest.raises(ValueError, match="writable"):
        BlockStore(b"abc", 2)
    bad = [[Transfer(0, 1, 2, 0)]]  # node 1 sends a block it does not hold
    with pytest.raises(ValueError, match="does not hold"):
        run_node(0, bad, ["127.0.0.1:1"] * 3, BlockStore(b"ab", 2, full=True))


def test_a_stale_sender_of_another_run_is_dropped_and_the_run_completes() -> None:
    """A sender left over from an earlier multicast to the same listener (another run's
    tag) is turned away; the receiver still gets every block from its own sender."""
    source = os.urandom(3 * 1024 + 5)
    listeners = [listen() for _ in range(2)]
    addresses = [address_of(s) for s in listeners]
    schedule = binomial_pipeline(1, block_count(len(source), 1024))
    stale = BlockStore(os.urandom(len(source)), 1024, full=True)
    stores = [BlockStore(source, 1024, full=True), BlockStore(bytearray(len(source)), 1024)]
    errors: dict[str, BaseException] = {}

    def node(k: int, store: BlockStore, name: str) -> None:
        try:
            run_node(k, schedule, addresses, store, listener=listeners[k], timeout=5, name=name)
        except BaseException as e:
            errors[f"{name}:{k}"] = e

    old = threading.Thread(target=node, args=(0, stale, "old-model"))
    old.start()  # connects first: the receiver must drop it
    time.sleep(0.2)
    threads = [threading.Thread(target=node, args=(k, stores[k], "model")) for k in range(2)]
    for t in threads:
        t.start()
    for t in (*threads, old):
        t.join(20)
    for s in listeners:
        s.close()
    # The run's own nodes finished (the stale sender may or may not see the hang-up).
    assert not {k: e for k, e in errors.items() if k.startswith("model:")}
    assert bytes(stores[1].view) == source

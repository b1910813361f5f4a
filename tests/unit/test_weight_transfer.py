"""Forking a model's weights from another host's cache over TCP: the same greedy output as a
load from disk, a checksum failure falls back to the checkpoint with a clear log line."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.task_executor.engines.base import LoadReport
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.weight_cache import fingerprint
from services.task_executor.weight_cache.store import HostWeightCache
from services.task_executor.weight_cache.transfer import WeightPeer, WeightServer
from tests.unit.test_torch_engine import _write_tiny_llama
from tests.unit.test_weight_cache import _outputs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture
def source(model_dir: Path, tmp_path: Path) -> Iterator[tuple[WeightServer, TorchEngine]]:
    """Another host: the model loaded through its cache, whose server is up."""
    cache = HostWeightCache(tmp_path / "source", 1 << 30)
    engine = _engine(model_dir, cache)
    server = WeightServer(cache.root).start()
    yield server, engine
    server.stop()


def _engine(model_dir: Path, cache: HostWeightCache | None, **kw: object) -> TorchEngine:
    engine = TorchEngine(
        model_dir, device="cpu", dtype="bfloat16", block_size=4, num_kv_blocks=64,
        weight_cache=cache, model_name="tiny", **kw,
    )  # fmt: skip
    if cache is not None:
        assert not engine.has_work()  # as a TE asks once loaded: the store may go
        assert cache.wait_stored(60)
    return engine


def test_a_forked_te_generates_what_one_loaded_from_disk_does(
    model_dir: Path, tmp_path: Path, source: tuple[WeightServer, TorchEngine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    server, _ = source
    expected = _outputs(_engine(model_dir, None))

    def no_hashing(path: Path) -> dict[str, str]:
        raise AssertionError("the fork should take the source's fingerprints")

    monkeypatch.setattr(fingerprint, "shard_fingerprints", no_hashing)
    cache = HostWeightCache(tmp_path / "here", 1 << 30)
    report = LoadReport()
    forked = _engine(model_dir, cache, load_report=report, weights_from=server.address)
    entries = len(list((server.root / "tensors").iterdir()))
    assert (report.fetched, report.misses) == (entries, 0)
    assert report.fetched_bytes == cache.used_bytes()
    assert "fetch" in report.phases and "build" not in report.phases
    assert _outputs(forked) == expected
    # This host can now serve the model in turn, and a later load here maps it.
    again = LoadReport()
    _engine(model_dir, cache, load_report=again)
    assert again.fetched == again.misses == 0 and again.hits > 0


def test_a_checksum_mismatch_falls_back_to_the_checkpoint_with_a_log_line(
    model_dir: Path, tmp_path: Path, source: tuple[WeightServer, TorchEngine],
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    server, _ = source
    server.corrupt_chunks = 1
    expected = _outputs(_engine(model_dir, None))
    cache = HostWeightCache(tmp_path / "here", 1 << 30)
    report = LoadReport()
    with caplog.at_level(logging.WARNING):
        forked = _engine(model_dir, cache, load_report=report, weights_from=server.address)
    assert report.fetched == 0 and report.misses > 0
    assert (
        "failed its checksum" in caplog.text
        and "loading the rest from the checkpoint" in caplog.text
    )
    assert _outputs(forked) == expected
    assert not list(cache.tensors_dir.glob(".*.tmp"))  # nothing torn left behind


def test_an_entry_the_source_lacks_is_built_and_the_rest_still_fetched(
    model_dir: Path, tmp_path: Path, source: tuple[WeightServer, TorchEngine]
) -> None:
    server, _ = source
    files = sorted((server.root / "tensors").iterdir(), key=lambda p: p.stat().st_size)
    files[-1].unlink()  # the largest entry is gone from the source
    cache = HostWeightCache(tmp_path / "here", 1 << 30)
    report = LoadReport()
    _engine(model_dir, cache, load_report=report, weights_from=server.address)
    assert report.misses == 1 and report.fetched == len(files) - 1


def test_a_peer_that_is_not_there_is_a_fork_error(tmp_path: Path) -> None:
    server = WeightServer(tmp_path).start()
    address = server.address
    server.stop()
    peer = WeightPeer(address, timeout=2)
    with pytest.raises(Exception, match="weight server"):
        peer.fingerprints("m")


def test_a_multicast_delivers_the_model_to_several_tes_at_once(
    model_dir: Path, tmp_path: Path, source: tuple[WeightServer, TorchEngine]
) -> None:
    import threading

    from services.task_executor.weight_cache import relay
    from services.task_executor.weight_cache.store import receive_multicast
    from shared.messages.scaling import Multicast

    server, _ = source
    expected = _outputs(_engine(model_dir, None))
    listeners = [relay.listen() for _ in range(3)]
    nodes = [server.relay_address, *(relay.address_of(li) for li in listeners)]
    results: dict[int, object] = {}

    def receive(node: int) -> None:
        plan = Multicast(node=node, nodes=nodes, source=server.address, block_bytes=64 << 10)
        try:
            results[node] = receive_multicast("tiny", plan, listeners[node - 1], timeout=20)
        except Exception as e:  # reported below
            results[node] = e

    threads = [threading.Thread(target=receive, args=(n,)) for n in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for li in listeners:
        li.close()
    entries = len(list((server.root / "tensors").iterdir()))
    for node in (1, 2, 3):
        received = results[node]
        assert not isinstance(received, Exception), received
        cache = HostWeightCache(tmp_path / f"te{node}", 1 << 30)
        report = LoadReport()
        engine = _engine(model_dir, cache, load_report=report, received=received)
        assert (report.fetched, report.misses) == (entries, 0)
        assert _outputs(engine) == expected

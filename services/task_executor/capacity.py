"""How much one instance of a model sustains on this engine and device, read off the
model's performance model (``shared.perf_model.PerfModel``: iteration times on power-of-two
grids, measured by ``perf_profile``): the scaler sizes each model's fleet from it
(``services/scaler/target.py``), and the device's shadow validation plays iterations forward
with the performance model itself.

Measured once per model architecture, engine and kind of host, offline where it can be:
``meshserve profile MODEL_DIR`` (``scripts/up`` and compose run it for the demo model)
measures the full grid and stores it with the model (``MODEL_STORE`` in the checkpoint's
directory) and on the host (``ProfileStore`` under ``MESHSERVE_CAPACITY_CACHE``). A load
finds it there (or the scaler hands the capacity over from Redis) and measures nothing;
only a load that finds none measures the grid's corners (``perf_profile.COARSE``: about a
second for the demo model) before it turns ready, and stores them in both places. Prompts
are random token ids (timing does not depend on content). ``meshserve-loadgen profile``
measures the simulator's cost model with the same two probes (``prefill_s`` and
``decode_step_s``)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import msgspec

from services.task_executor import perf_profile
from services.task_executor.engines.base import Engine
from shared.messages.scaling import InstanceCapacity
from shared.perf_model import PerfModel
from shared.settings import Settings

MODEL_STORE = Path(".meshserve") / "perf"  # under a checkpoint's directory


def _stores(model_path: Path, settings: Settings) -> list[ProfileStore]:
    return [
        ProfileStore(model_path / MODEL_STORE),
        ProfileStore(settings.task_executor.capacity_cache / "perf"),
    ]


def _key(engine: Engine, model_path: Path, settings: Settings) -> str:
    te = settings.task_executor
    return profile_key(
        model_path,
        engine=engine.name,
        device=engine.device,
        dtype=te.dtype,
        max_num_seqs=te.max_num_seqs,
        threads=te.torch_threads,
    )


def find_perf_model(
    engine: Engine, model_path: Path, settings: Settings
) -> tuple[PerfModel | None, str]:
    """The performance model of ``engine`` serving the model at ``model_path`` as
    ``settings`` set it up, and where it was: with the model (``"model"``) or on this host
    (``"host"``); each place keeps a copy of what the other has (best effort). (None,
    "none") when neither has one."""
    stores, key = _stores(model_path, settings), _key(engine, model_path, settings)
    found = [
        (store.get(key), where) for store, where in zip(stores, ("model", "host"), strict=True)
    ]
    # The full grid wherever it is, else the corners a load measured.
    ranked = sorted(
        ((p, where) for p, where in found if p is not None),
        key=lambda item: item[0].grid != "full",
    )
    if not ranked:
        return None, "none"
    perf, where = ranked[0]
    for store, (other, _) in zip(stores, found, strict=True):
        if other != perf:
            store.put(key, perf)
    return perf, where


def find_or_measure(
    engine: Engine, model_path: Path, settings: Settings, *, measure: bool = True
) -> tuple[InstanceCapacity | None, str]:
    """The capacity of ``engine`` serving the model at ``model_path``, read off its stored
    performance model (``find_perf_model``), and where that came from; with none stored,
    the grid's corners ``"measured"`` now (``perf_profile.COARSE``) and stored in both
    places, or (None, "none") when ``measure`` is false."""
    perf, where = find_perf_model(engine, model_path, settings)
    if perf is None:
        if not measure:
            return None, "none"
        perf, where = _measure(engine, model_path, settings, perf_profile.COARSE), "measured"
    return perf.capacity(), where


def _measure(
    engine: Engine, model_path: Path, settings: Settings, grid: perf_profile.Grid
) -> PerfModel:
    vocab = int(json.loads((model_path / "config.json").read_text())["vocab_size"])
    perf = perf_profile.measure_perf_model(
        engine, vocab=vocab, max_num_seqs=settings.task_executor.max_num_seqs, grid=grid
    )
    key = _key(engine, model_path, settings)
    for store in _stores(model_path, settings):
        store.put(key, perf)
    return perf


def profile_model(model_dir: Path, settings: Settings) -> tuple[PerfModel, str]:
    """``meshserve profile``: the model loaded as a TE with these settings loads it, its
    full performance model found (``"model"`` or ``"host"``) or measured (``"measured"``)
    and stored, the engine closed."""
    from services.task_executor.engines.base import LoadReport
    from services.task_executor.engines.factory import create_engine, prewarm

    prewarm(settings)
    engine = create_engine(model_dir.name, model_dir, settings, report=LoadReport())
    try:
        perf, where = find_perf_model(engine, model_dir, settings)
        if perf is not None and perf.grid == "full":
            return perf, where
        return _measure(engine, model_dir, settings, perf_profile.FULL), "measured"
    finally:
        engine.close()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def profile_key(model_path: Path, **engine: object) -> str:
    """What measured figures depend on: the model's architecture (its ``config.json``, not
    its weights: a fine-tuned variant runs at the same speed), the engine, device and dtype,
    the batch limit and threads, and the CPU (a shared cache directory may serve several
    kinds of hosts)."""
    config = json.loads((model_path / "config.json").read_text())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    what = {"config": config, **engine, "cpu": _cpu_name(), "cores": cores}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


class ProfileStore:
    """Performance models on disk, one file each, keyed by ``profile_key``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def get(self, key: str) -> PerfModel | None:
        try:
            return msgspec.json.decode(
                (self.directory / f"{key}.json").read_bytes(), type=PerfModel
            )
        except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError):
            return None

    def put(self, key: str, perf: PerfModel) -> None:
        """Atomic (a concurrent reader sees the old file or the new one); best effort."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.tmp"
            tmp.write_bytes(msgspec.json.encode(perf))
            tmp.replace(self.directory / f"{key}.json")
        except OSError:
            pass

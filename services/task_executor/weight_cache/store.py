"""The host weight cache of a node pool: a directory in host shared memory (``/dev/shm`` by
default) holding engine tensors by content key, shared by every TE on the host.

An engine tensor's key is xxh3-128 of its *form* (what the engine made of its sources: dtype,
fusion, packing and the host and torch versions the packing is valid for) and the
fingerprints of the checkpoint tensors it was made from (``fingerprint``). A load asks for each
of its tensors by sources and form (``CacheSession.tensor``):

- **hit**: the file is there; the TE maps it (``tensor_file``): nothing read from the
  checkpoint, nothing packed, nothing copied;
- **miss**: the TE builds the tensor as it would without a cache, writes it under a temporary
  name and renames it into place (readers never see half a file), then maps the file and drops
  its own copy, so that the next TE, and this one, share the same pages. A model sharing
  tensors with one already cached (a fine-tuned variant, a base under adapters, duplicate
  embeddings) writes only the tensors it does not share.

A TE holds a shared ``flock`` on every file it maps for as long as the tensor lives; an
entry is in use while any lock is held, and eviction (``eviction.choose_victims``, under the
directory's exclusive lock) never takes one in use: it takes the entry's exclusive lock before
it unlinks the file. A load that finds the file gone between its lookup and its lock builds
instead. When the entries that may go cannot make room, the new tensor stays the TE's own
(uncached) and the load goes on.

Per-entry statistics (first seen, last use, uses, hits, misses) and each model's manifest
(its keys and bytes, for ``t_load``) are kept in ``index.json`` beside the files, rewritten
under the lock at the end of each load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import xxhash

from services.task_executor.engines.base import LoadReport
from services.task_executor.weight_cache import relay, tensor_file
from services.task_executor.weight_cache.eviction import EntryView, EvictionConfig, choose_victims
from services.task_executor.weight_cache.fingerprint import (
    checkpoint_fingerprints,
    memoised,
    remember,
)
from services.task_executor.weight_cache.index import (
    SUFFIX,
    budget_bytes,
    read_index,
    residencies,
    used_bytes,
)
from services.task_executor.weight_cache.index import entry_size as _size
from services.task_executor.weight_cache.multicast import binomial_pipeline
from services.task_executor.weight_cache.transfer import ForkError, MissingEntry, WeightPeer
from shared.messages.cluster import CachedWeights
from shared.messages.scaling import Multicast
from shared.settings import Settings

log = logging.getLogger(__name__)


class HostWeightCache:
    def __init__(
        self,
        root: Path,
        budget_bytes: int,
        *,
        eviction: EvictionConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.eviction = eviction or EvictionConfig()
        self._clock = clock
        self.tensors_dir = root / "tensors"
        self.tensors_dir.mkdir(parents=True, exist_ok=True)
        (root / "fingerprints").mkdir(exist_ok=True)
        self._index_path = root / "index.json"
        self._lock = threading.Lock()
        self._storing: list[CacheSession] = []
        _remove_orphans(self.tensors_dir)

    @classmethod
    def from_settings(cls, settings: Settings) -> HostWeightCache | None:
        """The cache the settings ask for; None when it is off or its directory is unusable
        (logged: loads then read the checkpoint, as without a cache)."""
        hc = settings.host_cache
        if hc.bytes == 0:
            return None
        try:
            hc.dir.mkdir(parents=True, exist_ok=True)
            budget = budget_bytes(settings)
            eviction = EvictionConfig(hc.load_bandwidth, hc.horizon.total_seconds())
            return cls(hc.dir, budget, eviction=eviction)
        except OSError as e:
            log.warning("host weight cache off: %s is unusable (%s)", hc.dir, e)
            return None

    def session(
        self,
        model: str,
        model_dir: Path,
        report: LoadReport | None = None,
        weights_from: str | None = None,
        received: Received | None = None,
    ) -> CacheSession:
        """A load of ``model`` from the checkpoint in ``model_dir``: its tensors' fingerprints
        (memoised here, else the peer's, else hashed from the checkpoint), then ``tensor``
        per engine tensor, then ``finish``; what it does goes into ``report``.
        ``weights_from``: ``host:port`` of a weight server (another host's pool) that
        tensors missing here are fetched from before they are built from the checkpoint.
        ``received``: entries that arrived by multicast (``receive_multicast``), used before
        anything else."""
        t0 = time.monotonic()
        peer = WeightPeer(weights_from) if weights_from else None
        memo = self.root / "fingerprints"
        fps = memoised(model_dir, memo)
        if (
            fps is None
            and received is not None
            and remember(model_dir, memo, received.fingerprints)
        ):
            fps = dict(received.fingerprints)
        if fps is None and peer is not None:
            try:
                fps = peer.fingerprints(model)
            except ForkError as e:
                log.warning("fork of %s: %s; reading the checkpoint instead", model, e)
                peer = None
            if fps is not None and not remember(model_dir, memo, fps):
                log.warning(
                    "fork of %s: %s's tensors are not this checkpoint's; reading it instead",
                    model,
                    peer.address if peer else "the peer",
                )
                fps, peer = None, None
        if fps is None:
            fps = checkpoint_fingerprints(model_dir, memo)
        images = received.images if received is not None else None
        session = CacheSession(self, model, fps, report or LoadReport(), peer, images)
        session.report.add_phase("fingerprint", time.monotonic() - t0)
        return session

    def wait_stored(self, timeout: float | None = None) -> bool:
        """Until every load's store (``CacheSession.finish``) is done; False on timeout."""
        with self._lock:
            sessions = list(self._storing)
        return all(s.wait(timeout) for s in sessions)

    @staticmethod
    def key(form: str, fingerprints: Sequence[str]) -> str:
        return xxhash.xxh3_128_hexdigest(f"{form}|{','.join(fingerprints)}".encode())

    def path(self, key: str) -> Path:
        return self.tensors_dir / f"{key}{SUFFIX}"

    # -- the directory's state ------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[_Index]:
        """The directory's exclusive lock, with its index (read when first asked for,
        written back on exit where changed)."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            index = _Index(self.root)
            yield index
            if index.dirty:
                tmp = self._index_path.with_suffix(f".tmp{os.getpid()}")
                tmp.write_text(json.dumps(index.data))
                tmp.replace(self._index_path)
        finally:
            os.close(fd)

    def entries(self, index: Mapping[str, Any]) -> list[EntryView]:
        """Every file in the cache as the eviction policy sees it (in use: some TE's lock)."""
        now = self._clock()
        out = []
        for path in self.tensors_dir.glob(f"*{SUFFIX}"):
            key = path.name.removesuffix(SUFFIX)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                continue
            stats = index["entries"].get(key, {})
            out.append(
                EntryView(
                    key=key,
                    size=size,
                    first_seen=stats.get("first_seen", now),
                    last_use=stats.get("last_use", now),
                    uses=stats.get("uses", 1),
                    in_use=not _free(path),
                    alpha=stats.get("alpha", 1.0),
                )
            )
        return out

    def used_bytes(self) -> int:
        return used_bytes(self.root)

    def residencies(self) -> dict[str, CachedWeights]:
        return residencies(self.root)

    def _make_room(self, index: _Index, need: int, report: LoadReport) -> bool:
        """Under the lock: evict until ``need`` bytes fit; False when they cannot."""
        if self.used_bytes() + need <= self.budget_bytes:
            return True  # the common case: no eviction, no index to read
        entries = self.entries(index.data)
        victims = choose_victims(entries, need, self.budget_bytes, self._clock(), self.eviction)
        if victims is None:
            return False
        sizes = {e.key: e.size for e in entries}
        for key in victims:
            if _free(self.path(key), unlink=True):
                index.data["entries"].pop(key, None)
                index.dirty = True
                report.evicted_bytes += sizes[key]
                log.info("host cache evicted %s (%d bytes)", key, sizes[key])
            else:  # mapped since the view was taken: start over with the new view
                return self._make_room(index, need, report)
        return True


class _Index:
    """The index as a locked section sees it: read on first use, written where ``dirty``."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._data: dict[str, Any] | None = None
        self.dirty = False

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            self._data = read_index(self._root)
        return self._data


class CacheSession:
    """One model's load through the cache."""

    def __init__(
        self,
        cache: HostWeightCache,
        model: str,
        fingerprints: Mapping[str, str],
        report: LoadReport,
        peer: WeightPeer | None = None,
        received: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.cache = cache
        self.model = model
        self.fingerprints = fingerprints
        self.report = report
        self.peer = peer
        self.received = dict(received or {})  # key -> a tensor file's image (multicast)
        self._used: dict[str, bool] = {}  # key -> hit
        self._built: dict[str, torch.Tensor] = {}  # made or fetched here, to store
        self._replacements: dict[int, torch.Tensor] = {}
        self._stored = threading.Event()

    def tensor(
        self, sources: Sequence[str], form: str, build: Callable[[], torch.Tensor]
    ) -> torch.Tensor:
        """The engine tensor made from the checkpoint tensors ``sources`` as ``form`` says:
        mapped from the cache, else built by ``build`` (and stored after the load:
        ``finish``)."""
        key = self.cache.key(form, [self.fingerprints[s] for s in sources])
        path = self.cache.path(key)
        t0 = time.monotonic()
        mapped = self._built.get(key)  # the same values twice in one model
        if mapped is None:
            mapped = _map(path)
        if mapped is not None:
            self.report.add_phase("map", time.monotonic() - t0)
            self.report.hits += 1
            self.report.hit_bytes += _size(path)
            self._used[key] = True
            return mapped
        image = self.received.pop(key, None)
        fetched: torch.Tensor | None = None
        if image is not None:  # arrived by multicast
            fetched = tensor_file.from_image(image)
            self.report.fetched += 1
            self.report.fetched_bytes += image.numel()
        elif self.peer is not None:
            fetched = self._fetch(key)
        if fetched is not None:
            self.report.add_phase("fetch", time.monotonic() - t0)
        else:
            fetched = build()
            self.report.add_phase("build", time.monotonic() - t0)
            self.report.misses += 1
        self._used.setdefault(key, False)
        self._built[key] = fetched  # stored after the load (``finish``)
        return fetched

    def _fetch(self, key: str) -> torch.Tensor | None:
        """The entry from the peer, received into this process's memory (on transparent huge
        pages: filling new tmpfs pages costs these VMs ~0.35 GB/s, 4 KiB at a time) and
        served from there; stored into this host's cache after the load, like what a load
        builds. None when the peer lacks it, or after a failure (logged once: the rest of
        the load reads the checkpoint)."""
        assert self.peer is not None
        try:
            view = self.peer.fetch_into(key, _tensor_buffer)
        except MissingEntry:
            return None  # built here; the peer may hold the others
        except ForkError as e:
            log.warning(
                "fork of %s from %s failed (%s): loading the rest from the checkpoint",
                self.model,
                self.peer.address,
                e,
            )
            self.peer.close()
            self.peer = None
            return None
        image = torch.frombuffer(view, dtype=torch.uint8)
        self.report.fetched += 1
        self.report.fetched_bytes += image.numel()
        return tensor_file.from_image(image)

    def finish(
        self, alpha: float = 1.0, *, swap: bool = True, idle: threading.Event | None = None
    ) -> LoadReport:
        """The load is done: what it built is stored on a thread of its own, off the load's
        critical path (on this project's VMs, tmpfs takes about 0.4 GB/s of new pages), and
        the load's uses go into the index. With ``swap``, ``replacements`` then says which of
        the load's own tensors the cache now holds; without (an engine that will not swap:
        its weights are copies on a GPU), the session lets go of what it built once stored.
        ``idle``: set while the engine that loaded has no requests; the store writes only
        then (``tensor_file.WRITE_SLICE`` at a time, holding no lock while it waits), so the
        first requests after a first load never share the cores, the memory bandwidth or the
        GIL with it. Under unbroken traffic it waits for the first pause."""
        with self.cache._lock:
            self.cache._storing = [s for s in self.cache._storing if not s._stored.is_set()]
            self.cache._storing.append(self)
        threading.Thread(
            target=self._store_all, args=(alpha, swap, idle), name="host-cache-store"
        ).start()
        return self.report

    def wait(self, timeout: float | None = None) -> bool:
        """Until the store after ``finish`` is done; False on timeout."""
        return self._stored.wait(timeout)

    def replacements(self) -> dict[int, torch.Tensor] | None:
        """Once stored (None before): ``id(built tensor) -> the cache's mapping of it``, for
        the engine to swap in between steps, so that its private copies are freed and its
        pages are the ones every other TE maps. Handed out once."""
        if not self._stored.is_set():
            return None
        out, self._replacements = self._replacements, {}
        self._built.clear()
        return out

    def _store_all(self, alpha: float, swap: bool, idle: threading.Event | None) -> None:
        t0 = time.monotonic()
        # Behind the engine's own threads, should it get requests while a slice is written.
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        pace = idle.wait if idle is not None else None
        try:
            for key, built in self._built.items():
                mapped = self._store(key, built, pace)
                if mapped is not None and swap:
                    self._replacements[id(built)] = mapped
            if not swap:
                self._built.clear()
            self._record(alpha)
        except Exception:
            log.exception("host cache: storing %s's tensors failed", self.model)
        finally:
            self.report.add_phase("store_after_load", time.monotonic() - t0)
            self._stored.set()

    def _store(
        self, key: str, built: torch.Tensor, pace: Callable[[], object] | None
    ) -> torch.Tensor | None:
        """``built`` into the cache as ``key`` (unless there already), then mapped from it.
        Written to a temporary name outside the directory's lock (``pace`` may hold it back
        for as long as the engine is busy; other TEs map and store meanwhile), then renamed
        into place under the lock, with room made for it there."""
        cache = self.cache
        path = cache.path(key)
        size = tensor_file.HEADER_BYTES + tensor_file.nbytes(built)
        if pace is not None:
            pace()
        with cache.locked() as index:
            if not path.exists() and not self._room(index, key, size):
                return None
        if not path.exists():
            tmp = path.with_name(f".{key}.{threading.get_ident()}.{os.getpid()}.tmp")
            try:
                tensor_file.write(tmp, built, pace)
                with cache.locked() as index:
                    if path.exists():  # stored by another TE while this one wrote
                        tmp.unlink()
                    elif not self._room(index, key, size):
                        tmp.unlink()
                        return None
                    else:
                        tmp.replace(path)
                        self.report.stored_bytes += size
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        return _map(path)  # None only if evicted already: then the TE's own copy serves

    def _room(self, index: _Index, key: str, size: int) -> bool:
        """Under the lock: room for ``size`` more bytes made; False (logged, counted) when
        the budget cannot hold them: the entry stays the TE's own."""
        if self.cache._make_room(index, size, self.report):
            return True
        self.report.uncached_bytes += size
        log.info(
            "host cache full (budget %d bytes): %s stays private", self.cache.budget_bytes, key
        )
        return False

    def _record(self, alpha: float) -> None:
        """This load's uses into the index (and the model's manifest)."""
        now = self.cache._clock()
        keys = list(self._used)
        with self.cache.locked() as index:
            index.dirty = True
            entries = index.data["entries"]
            for key, hit in self._used.items():
                e = entries.setdefault(key, {"first_seen": now, "uses": 0, "hits": 0, "misses": 0})
                e["uses"] += 1
                e["hits" if hit else "misses"] += 1
                e["last_use"] = now
                e["alpha"] = max(e.get("alpha", 1.0), alpha)
            total = sum(_size(self.cache.path(k)) for k in keys)
            index.data["models"][self.model] = {
                "keys": keys,
                "bytes": total,
                "fingerprints": dict(self.fingerprints),  # served to forks (transfer.py)
            }
        if self.peer is not None:
            self.peer.close()


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """A model's entries received by multicast: key -> a tensor file's image (views into one
    buffer), and the checkpoint's fingerprints they were made from."""

    fingerprints: Mapping[str, str]
    images: Mapping[str, torch.Tensor]


def receive_multicast(
    model: str, plan: Multicast, listener: socket.socket, timeout: float = 60.0
) -> Received:
    """This TE's part of a multicast of ``model`` (``plan``): the manifest from the source's
    weight server (node 1 also starts the source sending), then every block through
    ``relay.run_node``, forwarded on as the schedule says; ``RelayError`` or ``ForkError``
    on failure (the caller forks instead)."""
    peer = WeightPeer(plan.source, timeout=timeout)
    try:
        manifest = peer.manifest(model)
        if plan.node == 1:
            peer.start_multicast(model, list(plan.nodes), plan.block_bytes)
    finally:
        peer.close()
    sizes = [int(n) for n in manifest["sizes"]]
    image = torch.empty(sum(sizes), dtype=torch.uint8)
    store = relay.BlockStore(image.numpy().data, plan.block_bytes)
    schedule = binomial_pipeline(len(plan.nodes) - 1, store.blocks)
    relay.run_node(
        plan.node, schedule, plan.nodes, store, listener=listener, timeout=timeout, name=model
    )
    images, offset = {}, 0
    for key, size in zip(manifest["keys"], sizes, strict=True):
        images[str(key)] = image[offset : offset + size]
        offset += size
    return Received(dict(manifest["fingerprints"]), images)


def _tensor_buffer(size: int) -> memoryview:
    """``size`` bytes of torch-allocated memory (huge pages where torch uses them)."""
    return torch.empty(size, dtype=torch.uint8).numpy().data.cast("B")


def _remove_orphans(directory: Path) -> None:
    """Half-written files (``.KEY[.THREAD].PID.tmp``) of processes that died while storing."""
    for tmp in directory.glob(".*.tmp"):
        pid = tmp.name.split(".")[-2]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            tmp.unlink(missing_ok=True)


def _map(path: Path) -> torch.Tensor | None:
    """The tensor in ``path``, mapped, with a shared lock held for its life; None when the
    file is absent (or was evicted between the open and the lock)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_ino != _inode(path):
            os.close(fd)
            return None
        t, mm = tensor_file.map_tensor(fd)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(t, _release, fd, mm)
    return t


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return -1


def _release(fd: int, mm: Any) -> None:
    with contextlib.suppress(BufferError, ValueError):
        mm.close()  # refused while another view of it lives; then it closes with them
    os.close(fd)  # drops the lock


def _free(path: Path, *, unlink: bool = False) -> bool:
    """Whether no TE maps ``path`` (its exclusive lock is free; a file already gone is);
    with ``unlink``, removed while that lock is held, so no TE maps it in between."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    else:
        if unlink:
            path.unlink(missing_ok=True)
        return True
    finally:
        os.close(fd)

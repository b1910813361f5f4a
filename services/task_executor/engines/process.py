"""An engine run in a child process, behind the same ``Engine`` protocol.

For engines whose native calls hold the GIL: OpenVINO GenAI's ``ContinuousBatchingPipeline``
(its ``step()`` binding keeps the GIL for the whole step, seconds for a long prompt chunk).
In the TE's own process such a step freezes the event loop: no heartbeat, no task accepted,
no token published. Here the TE's engine thread only waits on a pipe (which releases the GIL)
while the child computes.

Every call is one request/reply on the pipe, made by one thread at a time (the TE calls the
engine under its step lock, or from its engine thread). ``has_work()`` and ``stats()`` answer
from what the child sent with its last reply, without a round trip: the heartbeat reads
them from the event loop while a step may be running, and must not wait for it.

The child is a fresh interpreter (``python -m`` this module) that imports only what the
engine needs; the pipe is a socket pair handed to it as a file descriptor, and the engine's
factory crosses it pickled. ``python`` may name another interpreter than the TE's own: an
engine whose package cannot share the TE's environment (vLLM's CPU build pins its own torch
and transformers) runs from its own venv, with the repository put on its ``PYTHONPATH``.
The child's imports are this module's: the protocol's types (and msgspec).

The child exits when the parent closes the engine, or when the pipe breaks (the TE died);
a child that dies makes the next call raise ``EngineProcessDied``, which the TE treats as
an engine failure. Everything the engine held (a GPU's memory included) goes with the child.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.task_executor.engines.base import (
    Engine,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
)
from services.task_executor.engines.kv_events import KvEvent

# What the parent mirrors of the child's engine (beyond the protocol's methods).
_ATTRIBUTES = ("name", "device", "capabilities", "max_model_len", "block_size", "config")
_OPS = frozenset({"add_request", "abort", "step"})
STOP_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[3]  # the repository: what the child imports from
_NO_STATS = EngineStats(running=0, waiting=0, free_kv_blocks=0, total_kv_blocks=0)


class EngineProcessDied(RuntimeError):
    """The child process running the engine is gone."""


class ProcessEngine:
    """``factory()`` runs in the child and builds the engine there: it must be picklable (a
    module-level function, or ``functools.partial`` of one, or a class) and importable by the
    child's interpreter, ``python`` (default: this one)."""

    name: str
    device: str
    capabilities: EngineCapabilities
    max_model_len: int

    def __init__(
        self, factory: Callable[[], Engine], *, label: str = "engine", python: str | None = None
    ) -> None:
        mine, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        try:
            self._proc = subprocess.Popen(
                [python or sys.executable, "-m", __name__, str(theirs.fileno()), label],
                pass_fds=(theirs.fileno(),),
                env=env,
                cwd=ROOT,
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._conn = multiprocessing.connection.Connection(mine.detach())
        self._lock = threading.Lock()
        self._closed = False
        self._stats = _NO_STATS
        self._has_work = False
        self._final_events: list[KvEvent] = []  # what closing the engine said, kept for drain
        try:
            attributes = self._call("__init__", factory)
        except BaseException:
            self._stop()
            raise
        for key, value in attributes.items():
            setattr(self, key, value)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        """Whether the child process is still running."""
        return self._proc.poll() is None

    # --- Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        self._call("add_request", request)

    def abort(self, request_id: str) -> None:
        self._call("abort", request_id)

    def has_work(self) -> bool:
        return self._has_work

    def step(self) -> Sequence[EngineOutput]:
        return self._call("step")

    def stats(self) -> EngineStats:
        return self._stats

    def drain_kv_events(self) -> list[KvEvent]:
        """Also after close (the events closing produced, once), as engines do."""
        if self._closed:
            events, self._final_events = self._final_events, []
            return events
        return self._call("drain_kv_events")

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._final_events = self._call("close")
        except EngineProcessDied:
            pass
        finally:
            self._closed = True
            self._has_work = False
            self._stop()

    # --- the pipe ----------------------------------------------------------------------

    def _call(self, op: str, *args: Any) -> Any:
        if self._closed:
            raise RuntimeError("the engine is closed")
        with self._lock:
            try:
                self._conn.send((op, args))
                ok, value, stats, has_work = self._conn.recv()
            except (EOFError, OSError) as e:
                self._has_work = False
                raise EngineProcessDied(
                    f"the engine process exited (code {self._proc.poll()})"
                ) from e
        self._stats, self._has_work = stats, has_work
        if not ok:
            raise value
        return value

    def _stop(self) -> None:
        self._conn.close()
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """The child: build the engine (the first call carries its factory), then answer calls
    until closed or orphaned."""
    # Ctrl-C reaches the whole process group; the parent closes the engine on its way out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine: Engine | None = None
    op = ""
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        try:
            # Unpickled here, so that a factory this interpreter cannot import is reported.
            op, args = pickle.loads(data)
            if op == "__init__" and engine is None:
                (factory,) = args
                engine = factory()
                value: Any = {k: getattr(engine, k) for k in _ATTRIBUTES if hasattr(engine, k)}
            elif op == "close" and engine is not None:
                engine.close()  # then what closing produced (a cache cleared) goes back
                value = _drain(engine)
            elif op == "drain_kv_events" and engine is not None:
                value = _drain(engine)
            elif op in _OPS and engine is not None:
                value = getattr(engine, op)(*args)
            else:
                raise ValueError(f"unknown engine call {op!r}")
            reply = (True, value, *_state(engine))
        except Exception as e:  # sent to the parent, raised there
            reply = (False, _picklable(e), *_state(engine))
        try:
            conn.send(reply)
        except (EOFError, OSError):
            break
        if op == "close" or engine is None:
            break
    if engine is not None and op != "close":
        try:
            engine.close()
        except Exception:  # exiting anyway
            traceback.print_exc()


def _drain(engine: Engine) -> list[KvEvent]:
    drain = getattr(engine, "drain_kv_events", None)  # engines without a prefix index lack it
    return drain() if drain is not None else []


def _state(engine: Engine | None) -> tuple[EngineStats, bool]:
    if engine is None:
        return _NO_STATS, False
    try:
        return engine.stats(), engine.has_work()
    except Exception:  # a closed engine
        return _NO_STATS, False


def _picklable(e: Exception) -> Exception:
    """The exception itself when it crosses the pipe, else a RuntimeError that names it."""

    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


if __name__ == "__main__":  # the child: python -m services.task_executor.engines.process FD LABEL
    _serve(multiprocessing.connection.Connection(int(sys.argv[1])))

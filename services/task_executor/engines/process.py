"""An engine run in a child process, behind the same ``Engine`` protocol.

For engines whose native calls hold the GIL: OpenVINO GenAI's ``ContinuousBatchingPipeline``
(its ``step()`` binding keeps the GIL for the whole step, seconds for a long prompt chunk).
In the TE's own process such a step freezes the event loop: no heartbeat, no task accepted,
no token published. Here the TE's engine thread only waits on a pipe (which releases the GIL)
while the child computes. It also isolates an engine whose package cannot share the TE's
environment (vLLM's CPU build pins its own torch and transformers): ``python`` may name
another venv's interpreter, which runs with the repository on its ``PYTHONPATH``.

Every call is one request/reply on the pipe, made by one thread at a time (the TE calls the
engine under its step lock, or from its engine thread). Calls and replies are msgspec Structs
encoded with msgpack (``pipe.py``), never pickle: the child's capabilities, requests, outputs
and KV events cross as the same typed values the engine uses in-process. ``has_work()``,
``stats()`` and ``adapters()`` answer from what the child sent with its last reply, without a
round trip: the heartbeat reads them from the event loop while a step may be running, and
must not wait.

What crosses the pipe bounds what the engine can do from here: generating, KV events and
LoRA adapters (``LoraServing``: loaded, unloaded and pinned by name and path; a request names
its adapter in ``EngineRequest.adapter``). The other capabilities (KV export and import,
pinning, the host tier, weights handed over as tensors, prefill pacing, KV resizing) need
tensors or calls the pipe does not carry, so the parent does not claim them even where the
child's engine has them.

The child exits when the parent closes the engine, or when the pipe breaks (the TE died);
a child that dies makes the next call raise ``EngineProcessDied``, which the TE treats as
an engine failure. Everything the engine held (a GPU's memory included) goes with the child.
"""

from __future__ import annotations

import multiprocessing.connection
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from services.task_executor.engines.base import (
    IDLE_STATS,
    Engine,
    EngineCapabilities,
    EngineOutput,
    EngineRequest,
    EngineStats,
    PrefillBudget,
)
from services.task_executor.engines.capabilities import (
    CapabilityError,
    KvEventSource,
    LoraServing,
    bind_features,
)
from services.task_executor.engines.pipe import (
    Abort,
    AddRequest,
    Build,
    Built,
    Call,
    Close,
    Done,
    DrainKvEvents,
    Events,
    FactorySpec,
    Failed,
    LoadAdapter,
    Outputs,
    PinAdapter,
    Reply,
    Result,
    Step,
    UnloadAdapter,
    Unloaded,
    decode_call,
    decode_reply,
    encode,
)
from shared.messages.kv import KvEvent
from shared.messages.tasks import TaskMode

STOP_TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[3]  # the repository: what the child imports from
_R = TypeVar("_R", bound=Result)


class EngineProcessDied(RuntimeError):
    """The child process running the engine is gone."""


class ProcessEngine:
    """``factory`` runs in the child and builds the engine there: a ``FactorySpec``, or a
    module-level class or function (or ``functools.partial`` of one) with arguments msgpack
    can carry, which becomes one. The child's interpreter, ``python`` (default: this one),
    must be able to import it."""

    name: str
    device: str
    capabilities: EngineCapabilities
    max_model_len: int
    block_size: int
    prefill_budget: PrefillBudget

    def __init__(
        self,
        factory: FactorySpec | Callable[[], Engine],
        *,
        label: str = "engine",
        python: str | None = None,
    ) -> None:
        # Here, not at the top: the child imports this module too, and has no settings.
        from shared.settings import process_environment

        spec = factory if isinstance(factory, FactorySpec) else FactorySpec.of(factory)
        mine, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [python or sys.executable, "-m", __name__, str(theirs.fileno()), label],
                pass_fds=(theirs.fileno(),),
                env=process_environment(pythonpath=[ROOT]),
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
        self._stats = IDLE_STATS
        self._has_work = False
        self._adapters: list[str] = []
        self._final_events: list[KvEvent] = []  # what closing the engine said, kept for drain
        try:
            built = self._call(Build(factory=spec), Built)
        except BaseException:
            self._stop()
            raise
        self.name, self.device = built.name, built.device
        self.max_model_len, self.block_size = built.max_model_len, built.block_size
        self.prefill_budget = built.prefill_budget
        # Only what crosses the pipe, whatever the child's engine has (a capability added
        # later stays off here until the pipe carries it).
        child = built.capabilities
        self.capabilities = EngineCapabilities(
            modes=frozenset({TaskMode.COLOCATED}),  # no KV leaves or enters the child
            prefix_cache=child.prefix_cache,
            kv_events=child.kv_events,
            lora=child.lora,
        )

    @property
    def pid(self) -> int:
        return self._proc.pid

    def alive(self) -> bool:
        """Whether the child process is still running."""
        return self._proc.poll() is None

    # --- Engine protocol ---------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        self._call(AddRequest(request=request), Done)

    def abort(self, request_id: str) -> None:
        self._call(Abort(request_id=request_id), Done)

    def has_work(self) -> bool:
        return self._has_work

    def step(self) -> Sequence[EngineOutput]:
        return self._call(Step(), Outputs).outputs

    def stats(self) -> EngineStats:
        return self._stats

    # --- LoraServing (used only where the child's engine declares lora) -------------------

    def load_adapter(self, name: str, path: str) -> None:
        self._call(LoadAdapter(name=name, path=path), Done, lora=True)

    def unload_adapter(self, name: str) -> bool:
        return self._call(UnloadAdapter(name=name), Unloaded, lora=True).found

    def pin_adapter(self, name: str, pinned: bool) -> None:
        self._call(PinAdapter(name=name, pinned=pinned), Done, lora=True)

    def adapters(self) -> list[str]:
        """As of the child's last reply."""
        return list(self._adapters)

    # --- KvEventSource (used only where the child's engine declares kv_events) ----------

    def drain_kv_events(self) -> list[KvEvent]:
        """Also after close (the events closing produced, once), as engines do."""
        if self._closed:
            events, self._final_events = self._final_events, []
            return events
        return self._call(DrainKvEvents(), Events).events

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._final_events = self._call(Close(), Events).events
        except EngineProcessDied:
            pass
        finally:
            self._closed = True
            self._has_work = False
            self._stop()

    # --- the pipe ----------------------------------------------------------------------

    def _call(self, call: Call, expect: type[_R], *, lora: bool = False) -> _R:
        if self._closed:
            raise RuntimeError("the engine is closed")
        if lora and not self.capabilities.lora:
            raise CapabilityError(f"the {self.name} engine serves no LoRA adapters")
        with self._lock:
            try:
                self._conn.send_bytes(encode(call))
                reply = decode_reply(self._conn.recv_bytes())
            except (EOFError, OSError) as e:
                self._has_work = False
                raise EngineProcessDied(
                    f"the engine process exited (code {self._proc.poll()})"
                ) from e
        self._stats, self._has_work, self._adapters = reply.stats, reply.has_work, reply.adapters
        result = reply.result
        if isinstance(result, Failed):
            raise result.exception()
        if not isinstance(result, expect):
            raise RuntimeError(f"the engine process answered {type(call).__name__} with {result}")
        return result

    def _stop(self) -> None:
        self._conn.close()
        try:
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


# --- the child ------------------------------------------------------------------------------


class _Child:
    """The engine in the child, and one handler per call type."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.kv: KvEventSource | None = None
        self.lora: LoraServing | None = None
        self.closed = False
        self._handlers: dict[type[Call], Callable[..., Result]] = {
            Build: self._build,
            AddRequest: self._add,
            Abort: self._abort,
            Step: self._step,
            DrainKvEvents: self._drain,
            Close: self._close,
            LoadAdapter: self._load_adapter,
            UnloadAdapter: self._unload_adapter,
            PinAdapter: self._pin_adapter,
        }

    def handle(self, call: Call) -> Result:
        if self.engine is None and not isinstance(call, Build):
            raise RuntimeError(f"{type(call).__name__} before the engine was built")
        return self._handlers[type(call)](call)

    def _built(self) -> Engine:
        assert self.engine is not None
        return self.engine

    def _build(self, call: Build) -> Built:
        if self.engine is not None:
            raise RuntimeError("the engine is built already")
        self.engine = engine = call.factory.build()
        features = bind_features(engine)
        self.kv, self.lora = features.kv_events, features.lora
        return Built(
            name=engine.name,
            device=engine.device,
            max_model_len=engine.max_model_len,
            capabilities=engine.capabilities,
            prefill_budget=engine.prefill_budget,
            block_size=self.kv.block_size if self.kv is not None else 0,
        )

    def _add(self, call: AddRequest) -> Done:
        self._built().add_request(call.request)
        return Done()

    def _abort(self, call: Abort) -> Done:
        self._built().abort(call.request_id)
        return Done()

    def _step(self, _: Step) -> Outputs:
        return Outputs(outputs=list(self._built().step()))

    def _lora(self) -> LoraServing:
        if self.lora is None:
            raise CapabilityError(f"the {self._built().name} engine serves no LoRA adapters")
        return self.lora

    def _load_adapter(self, call: LoadAdapter) -> Done:
        self._lora().load_adapter(call.name, call.path)
        return Done()

    def _unload_adapter(self, call: UnloadAdapter) -> Unloaded:
        return Unloaded(found=self._lora().unload_adapter(call.name))

    def _pin_adapter(self, call: PinAdapter) -> Done:
        self._lora().pin_adapter(call.name, call.pinned)
        return Done()

    def _drain(self, _: DrainKvEvents | None = None) -> Events:
        return Events(events=self.kv.drain_kv_events() if self.kv is not None else [])

    def _close(self, _: Close) -> Events:
        self._built().close()
        self.closed = True
        return self._drain()  # what closing produced (a cache cleared)

    def state(self) -> tuple[EngineStats, bool, list[str]]:
        if self.engine is None or self.closed:
            return IDLE_STATS, False, []
        try:
            adapters = self.lora.adapters() if self.lora is not None else []
            return self.engine.stats(), self.engine.has_work(), adapters
        except Exception:  # an engine that failed half-way: the call's own error says why
            return IDLE_STATS, False, []


def _serve(conn: multiprocessing.connection.Connection) -> None:
    """The child: build the engine (the first call), then answer calls until closed or
    orphaned."""
    # Ctrl-C reaches the whole process group; the parent closes the engine on its way out.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    child = _Child()
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        try:
            # Decoded here, so that a factory this interpreter cannot import is reported.
            result: Result = child.handle(decode_call(data))
        except Exception as e:  # sent to the parent, raised there
            result = Failed.of(e)
        stats, has_work, adapters = child.state()
        reply = Reply(result=result, stats=stats, has_work=has_work, adapters=adapters)
        try:
            conn.send_bytes(encode(reply))
        except (EOFError, OSError):
            break
        if child.closed or child.engine is None:
            break
    if child.engine is not None and not child.closed:
        try:
            child.engine.close()
        except Exception:  # exiting anyway
            traceback.print_exc()


if __name__ == "__main__":  # the child: python -m services.task_executor.engines.process FD LABEL
    _serve(multiprocessing.connection.Connection(int(sys.argv[1])))

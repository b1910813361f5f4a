"""Launching an iteration's forward and sampling without waiting for them: what lets the engine
schedule the next iteration while the current one runs (SGLang's zero-overhead scheduler,
vLLM's async scheduling).

A ``Launch`` is one forward plus sampling whose tokens stay on the device until asked for. Two
launchers, by device:
- ``InlineLauncher`` (CUDA): kernels are asynchronous already, so the launch runs in the calling
  thread and returns once the kernels are queued. The tokens are copied to pinned host memory
  behind them, with an event: reading them waits for that iteration only, not for one queued
  after it (a plain ``.tolist()`` would synchronize the whole stream). Everything that touches
  the KV cache afterwards is queued on the same stream, so it is ordered after the launch.
- ``ThreadLauncher`` (CPU, opt-in: see ``make_launcher``): ops run eagerly in the calling
  thread, so an iteration launched ahead runs on one worker thread (torch releases the GIL
  inside its kernels) while the caller turns the previous iteration's tokens into outputs; one
  the caller waits for at once runs in the caller's thread. The caller must ``settle`` a launch
  ahead before it launches another or writes KV-cache memory itself.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(slots=True)
class OverlapStats:
    """How the launches ahead went (cumulative)."""

    launched: int = 0  # iterations launched before the previous one's tokens were read
    rows_used: int = 0  # rows of those whose tokens became outputs
    rows_wasted: int = 0  # rows computed for requests that had finished, left or changed


class Launch:
    """The tokens ``[rows]`` of one launched iteration."""

    __slots__ = ("_event", "_future", "_host", "_tokens")

    def __init__(
        self,
        *,
        tokens: torch.Tensor | None = None,
        host: torch.Tensor | None = None,
        event: torch.cuda.Event | None = None,
        future: concurrent.futures.Future[torch.Tensor] | None = None,
    ) -> None:
        self._tokens, self._host, self._event, self._future = tokens, host, event, future

    def device_tokens(self) -> torch.Tensor:
        """The tokens where they were sampled. From another launch on the same launcher this
        never waits (the launches are ordered); from the caller it may."""
        if self._future is not None:
            return self._future.result()
        assert self._tokens is not None
        return self._tokens

    def host_tokens(self) -> list[int]:
        """The tokens on the host; waits for this launch (only)."""
        if self._future is not None:
            return self._future.result().tolist()
        if self._event is not None:
            self._event.synchronize()
        assert self._host is not None
        return self._host.tolist()

    def settle(self) -> None:
        """Wait until the launch no longer touches memory the caller may write next (a no-op
        where the device orders the caller's later work after it). Raises what it raised."""
        if self._future is not None:
            self._future.result()


class InlineLauncher:
    def launch_now(self, run: Callable[[], torch.Tensor]) -> Launch:
        """An iteration the caller waits for before it launches anything else."""
        return self.launch_ahead(run)

    def launch_ahead(self, run: Callable[[], torch.Tensor]) -> Launch:
        """An iteration that runs while the caller goes on."""
        tokens = run()
        if tokens.device.type != "cuda":
            return Launch(tokens=tokens, host=tokens)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        # On the tokens' device: the calling thread's current device may be another one.
        event.record(torch.cuda.current_stream(tokens.device))
        return Launch(tokens=tokens, host=host, event=event)

    def close(self) -> None:
        pass


class ThreadLauncher:
    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="torch-engine-forward"
        )

    def launch_now(self, run: Callable[[], torch.Tensor]) -> Launch:
        # The caller waits for it anyway (and nothing else runs now): no thread hop.
        tokens = run()
        return Launch(tokens=tokens, host=tokens)

    def launch_ahead(self, run: Callable[[], torch.Tensor]) -> Launch:
        return Launch(future=self._pool.submit(_inference, run))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _inference(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():  # thread-local: the worker enters it itself
        return run()


Launcher = InlineLauncher | ThreadLauncher


def make_launcher(device: torch.device, *, on_cpu: bool = False) -> Launcher | None:
    """The launcher for ``device``, or None where iterations run synchronously.

    On CPU there is nothing to gain by default: the forward already keeps every core busy (the
    host's bookkeeping would take a core from it), and a small model's forward is Python
    holding the GIL. Measured on a 2-core host, the forward thread bought nothing beyond the
    noise (about +-5% for a Qwen2-0.5B-shaped model, more for the demo model) while the
    pipelined bookkeeping costs ~13 us of host time a step; so the thread is opt-in
    (``on_cpu``), for hosts with cores to spare."""
    if device.type == "cuda":
        return InlineLauncher()
    if device.type == "cpu" and on_cpu:
        return ThreadLauncher()
    return None

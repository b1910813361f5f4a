"""The torch engine's overlapped iterations (``async_scheduling``).

Steady decoding knows the next iteration before this one's tokens are on the host: the same
requests, one position further. So a decode step launches the next iteration right behind its
own, fed by the tokens still on the device, and only then waits for its own tokens and does
the bookkeeping; the next step() finds its forward already launched (or, with the forward
thread on CPU, already computed while the caller handled the outputs).

The launched-ahead iteration is used only for what the synchronous path would run: at the next
step, the engine's ``_schedule`` decides as always (adds, aborts, preemption, admissions), and
each scheduled request whose position the ahead iteration computed takes its row; the rest run
in a fresh launch. Rows of requests that finished (EOS, found one step late) or were aborted
are thrown away. Seeded sampling stays exact because a request's draws are taken in token
order and kept until the token is used (``Seq.uniforms``).

Requests producing their first token never launch ahead (it would delay their TTFT on CUDA:
the host launches the next forward before it reads this one's tokens), nor do iterations after
which requests would be admitted or preempted (the ahead iteration would be thrown away).

A part of ``TorchEngine``: it reads and drives the engine's requests through the engine's own
iteration parts (``_schedule``, ``_batch``, ``_apply``)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from services.task_executor.engines.torch_engine import sampling
from services.task_executor.engines.torch_engine.model import SeqChunk, build_batch, to_device
from services.task_executor.engines.torch_engine.overlap import Launch, Launcher, OverlapStats
from services.task_executor.engines.torch_engine.scheduler import schedule
from services.task_executor.engines.torch_engine.sequence import Seq, running_view, waiting_view

if TYPE_CHECKING:
    from services.task_executor.engines.base import EngineOutput
    from services.task_executor.engines.torch_engine.engine import TorchEngine


@dataclasses.dataclass(slots=True, eq=False)
class Ahead:
    """An iteration launched before the previous one's tokens reached the host."""

    launch: Launch
    size: int  # rows
    # request -> (row, position it computes, block that position is written to)
    rows: dict[Seq, tuple[int, int, int]]

    def reusable(self, scheduled: Sequence[Seq], block_size: int) -> dict[Seq, int]:
        """The rows that computed what ``scheduled`` needs now: the same request at the same
        position in the same block."""
        found = {}
        for r in scheduled:
            rec = self.rows.get(r)
            if rec is None:
                continue
            row, pos, block = rec
            if (
                r.num_computed == pos
                and len(r.token_ids) == pos + 1
                and r.blocks[pos // block_size] == block
            ):
                found[r] = row
        return found


class OverlappedStepper:
    def __init__(self, engine: TorchEngine, launcher: Launcher) -> None:
        self._engine = engine
        self.launcher = launcher
        self.ahead: Ahead | None = None
        self.stats = OverlapStats()

    @torch.inference_mode()
    def step(self) -> list[EngineOutput]:
        engine = self._engine
        engine._check_open()
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.launch.settle()  # on CPU, the cache is the host's again
        scheduled = engine._schedule()
        if not scheduled:
            if ahead is not None:
                self.stats.rows_wasted += ahead.size
            return []
        sources: list[tuple[Launch, int]] = []  # launches holding this iteration's tokens
        where: dict[Seq, tuple[int, int]] = {}  # request -> (source, row)
        if ahead is not None:
            reused = ahead.reusable(scheduled, engine.block_size)
            self.stats.rows_used += len(reused)
            self.stats.rows_wasted += ahead.size - len(reused)
            if reused:
                sources.append((ahead.launch, ahead.size))
                where = {r: (0, row) for r, row in reused.items()}
        fresh = [r for r in scheduled if r not in where]
        if fresh:
            sampled = [r for r in fresh if r.samples]
            where.update((r, (len(sources), row)) for row, r in enumerate(sampled))
            sources.append((self._launch(fresh), len(sampled)))
        try:
            self.ahead = self._look_ahead(scheduled, sources, where)
            host = [launch.host_tokens() for launch, _ in sources]
        except BaseException:
            # Nothing launched may still run when the next step writes the cache.
            for launch, _ in sources:
                with contextlib.suppress(Exception):
                    launch.settle()
            self.quiesce()
            raise
        tokens = [host[src][row] for src, row in (where[r] for r in scheduled if r.samples)]
        return engine._apply(scheduled, tokens)

    def quiesce(self) -> None:
        """Wait for a launched-ahead iteration before the host writes KV-cache memory outside
        step(). One that failed is dropped (its rows are recomputed; a lasting fault shows in
        the next step)."""
        if self.ahead is None:
            return
        try:
            self.ahead.launch.settle()
        except Exception:
            self.ahead = None

    def close(self) -> None:
        self.quiesce()
        self.launcher.close()

    def _launch(self, reqs: Sequence[Seq]) -> Launch:
        """Forward ``reqs`` as scheduled and sample those that produce a token (the
        synchronous path's iteration)."""
        engine = self._engine
        batch = engine._batch(reqs)
        sampled = [r for r in reqs if r.samples]
        params, uniforms = [r.sampling for r in sampled], uniforms_for(sampled, 0)
        runner, cache = engine.runner, engine.cache

        def run() -> torch.Tensor:
            return sampling.sample_tokens(runner.forward(batch, cache), params, uniforms)

        return self.launcher.launch_now(run)

    def _look_ahead(
        self,
        scheduled: Sequence[Seq],
        sources: Sequence[tuple[Launch, int]],
        where: dict[Seq, tuple[int, int]],
    ) -> Ahead | None:
        """Launch the iteration after ``scheduled`` (whose tokens are still in ``sources``)
        when it is predictable; None when it is not."""
        engine = self._engine
        max_len, bs, sched = engine.max_model_len, engine.block_size, engine._sched
        going_on = []
        need = 0  # new blocks the next iteration takes
        for r in scheduled:
            n = len(r.token_ids)
            if n - r.num_computed != 1 or n == r.prompt_len:
                return None  # someone's first token (or a prefill) is in this iteration
            if n - r.prompt_len + 1 < r.sampling.max_tokens and n + 1 < max_len:
                going_on.append(r)
                need += n >= len(r.blocks) * bs
        if not going_on:
            return None
        # The synchronous path's next decision, as far as it is known now (a stop token may
        # still end a request, and the caller may add or abort some): nothing may join or be
        # preempted, else the ahead iteration would be thrown away.
        pc = engine.prefix_cache
        room = sched.max_num_seqs - len(going_on)
        if engine._waiting and room > 0:
            running = [running_view(r, sched.pacing, ahead=1) for r in going_on]
            now = time.monotonic()
            waiting = [waiting_view(r, pc, bs, now) for r in engine._waiting_head(room, now)]
            decision = schedule(running, waiting, pc.num_free, sched)
            if decision.preempt or decision.prefill:
                return None
        elif need > pc.num_free:
            return None  # the scheduler would preempt

        rows = {}
        chunks = []
        for row, r in enumerate(going_on):
            pos = len(r.token_ids)  # where this iteration's token goes
            if pos >= len(r.blocks) * bs:
                pc.append(r.blocks, pos + 1)  # what the next _schedule would do, a step early
            rows[r] = (row, pos, r.blocks[pos // bs])
            chunks.append(SeqChunk((0,), pos, r.blocks))
        device = engine.torch_device
        placeholder = torch.empty(0, dtype=torch.long)
        meta = build_batch(
            chunks,
            block_size=bs,
            device=device,
            input_ids=placeholder,
            adapter_slots=engine._adapter_slots(going_on),  # held: running requests' slots
        )
        offsets = list(itertools.accumulate((n for _, n in sources), initial=0))
        picks = [offsets[src] + row for src, row in map(where.__getitem__, going_on)]
        pick = None
        if picks != list(range(offsets[-1])):
            pick = to_device(picks, torch.long, device)
        launches = [launch for launch, _ in sources]
        params, uniforms = [r.sampling for r in going_on], uniforms_for(going_on, 1)
        runner, cache = engine.runner, engine.cache

        def run() -> torch.Tensor:
            prev = [launch.device_tokens() for launch in launches]
            ids = prev[0] if len(prev) == 1 else torch.cat(prev)
            if pick is not None:
                ids = ids.index_select(0, pick)
            logits = runner.forward(dataclasses.replace(meta, input_ids=ids), cache)
            return sampling.sample_tokens(logits, params, uniforms)

        self.stats.launched += 1
        return Ahead(self.launcher.launch_ahead(run), len(going_on), rows)


def uniforms_for(reqs: Sequence[Seq], ahead: int) -> list[torch.Tensor]:
    """For each request that samples, the draw for its token ``ahead`` tokens after the one
    it produces next, taken now if it was not taken yet (draws stay in token order)."""
    out = []
    for r in reqs:
        if r.sampling.temperature != 0:
            while len(r.uniforms) <= ahead:
                r.uniforms.append(sampling.draw(r.generator))
            out.append(r.uniforms[ahead])
    return out

"""Jobs into task graphs, and what a job executor that takes a graph over continues. Pure.

A chat job is one colocated task, or a prefill task whose KV a decode task continues from
(``disaggregation.decide`` chose the pair); the fine-tuning jobs add preprocess → train →
evaluate to the same planner. A chat graph's work is done once the task that streams its
tokens is placed: from then on the TE streams to the frontend, which owns the request (and
places it again should the TE die). So what a successor can continue of a chat graph is its
prefill: placed, its KV offered under a lease until a decode task pulls it."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection

import msgspec

from shared.messages.tasks import KvSource, TaskMode
from shared.messages.training import TrainStage
from shared.task_graphs import GraphTask, TaskGraph, TaskState

CHAT, FINE_TUNE = "chat", "fine_tune"
GENERATE, PREFILL, DECODE = "generate", "prefill", "decode"  # a chat graph's task names
# States in which a task may be running on its TE (a placing one: its answer is not known).
MAY_RUN = (TaskState.PLACING, TaskState.PLACED)


def plan_chat(
    *,
    graph_id: str,
    model: str,
    deadline: float,
    prompt: str,
    decode_te: str,
    prefill_te: str | None = None,
) -> TaskGraph:
    """The graph of a chat job placed on ``decode_te``: one colocated task there, or, with
    ``prefill_te``, a prefill there whose KV streams to the decode task as it computes (the
    decode task may start once the prefill is placed)."""
    if prefill_te is None:
        tasks = [GraphTask(name=GENERATE, kind=TaskMode.COLOCATED, te_id=decode_te)]
    else:
        tasks = [
            GraphTask(name=PREFILL, kind=TaskMode.PREFILL, streams=True, te_id=prefill_te),
            GraphTask(name=DECODE, kind=TaskMode.DECODE, after=(PREFILL,), te_id=decode_te),
        ]
    return TaskGraph(
        graph_id=graph_id, kind=CHAT, model=model, deadline=deadline, prompt=prompt, tasks=tasks
    )


def plan_fine_tune(*, job_id: str, model: str, deadline: float) -> TaskGraph:
    """A fine-tuning job: preprocess (read the files with the model's tokenizer, resolve the
    ``auto`` hyperparameters) → train (a checkpoint per epoch) → evaluate (the adapter's
    losses; publish it). Each task runs on an idle TE; the names are the stages'."""
    preprocess, train, evaluate = (str(s) for s in TrainStage)
    tasks = [
        GraphTask(name=preprocess, kind=preprocess),
        GraphTask(name=train, kind=train, after=(preprocess,)),
        GraphTask(name=evaluate, kind=evaluate, after=(train,)),
    ]
    return TaskGraph(graph_id=job_id, kind=FINE_TUNE, model=model, deadline=deadline, tasks=tasks)


def resumed(graph: TaskGraph) -> tuple[TaskGraph, tuple[GraphTask, ...]]:
    """A fine-tuning graph taken over from a dead job executor: the tasks that may still run
    on their TE are to be cancelled there, and run again (training from its last checkpoint):
    the graph with them planned again, and them."""
    stray = tuple(t for t in graph.tasks if t.state in MAY_RUN)
    for task in stray:
        graph = with_task(graph, task.name, state=TaskState.PLANNED, te_id="")
    return graph, stray


def durable(graph: TaskGraph) -> bool:
    """Whether the graph is worth keeping in Redis while it runs: only a graph whose tasks
    hand work to each other leaves something a successor can continue (a one-task chat
    graph's continuation is the frontend placing the request again)."""
    return any(t.after for t in graph.tasks)


def ready(graph: TaskGraph) -> list[GraphTask]:
    """The planned tasks whose inputs are there: each task they follow is done, or placed
    if it streams its output as it runs."""
    by_name = {t.name: t for t in graph.tasks}

    def satisfied(name: str) -> bool:
        up = by_name[name]
        return up.state == TaskState.DONE or (up.streams and up.state == TaskState.PLACED)

    return [t for t in graph.tasks if t.state == TaskState.PLANNED and all(map(satisfied, t.after))]


@dataclasses.dataclass(frozen=True, slots=True)
class Continuation:
    """What a job executor that took over a dead one's chat graph does: place the decode
    task from ``source`` (a prefill the dead one placed; None: plan the job anew), after
    cancelling ``cancel`` (tasks that may run on their TE and are not continued)."""

    source: KvSource | None
    cancel: tuple[GraphTask, ...]


def continuation(graph: TaskGraph, *, prompt: str, live_tes: Collection[str]) -> Continuation:
    """The prefill's KV is continued when the prefill was placed, on a TE still alive, for
    this very prompt. A decode task the dead JE was placing is cancelled: should it have
    pulled the KV already (the lease released), the new decode task's pull fails and it
    prefills the prompt itself, as for any lost transfer."""
    by_name = {t.name: t for t in graph.tasks}
    prefill = by_name.get(PREFILL)
    reuse = (
        prefill is not None
        and prefill.state == TaskState.PLACED
        and prefill.kv_source is not None
        and prefill.te_id in live_tes
        and graph.prompt == prompt
    )
    source = prefill.kv_source if reuse and prefill is not None else None
    cancel = tuple(t for t in graph.tasks if t.state in MAY_RUN and not (reuse and t is prefill))
    return Continuation(source=source, cancel=cancel)


def abandoned(graph: TaskGraph, *, now: float) -> bool:
    """An orphaned chat graph past its deadline: nobody will continue it (the frontend
    places a request again well within its placement deadline); its tasks are cancelled."""
    return graph.kind == CHAT and now > graph.deadline


def with_task(graph: TaskGraph, name: str, **changes: object) -> TaskGraph:
    """The graph with one task changed (graphs are values: a new one per step)."""
    tasks = [msgspec.structs.replace(t, **changes) if t.name == name else t for t in graph.tasks]
    return msgspec.structs.replace(graph, tasks=tasks)

"""The pure parts of fine-tuning: request checks, the plan and its take-over, which TE trains,
``auto`` hyperparameters, names and pages."""

from __future__ import annotations

import msgspec
import pytest

from services.frontend.fine_tuning import parse_job_request
from services.job_executor.fine_tuning import asked_params, training_te
from services.job_executor.planner import durable, plan_fine_tune, ready, resumed, with_task
from services.task_executor.training.stages import auto_params
from shared.errors import BadRequest
from shared.fine_tuning import FineTuneJob, Hyperparameters, fine_tuned_name, page
from shared.messages.cluster import CachedWeights, TEHeartbeat, TEState
from shared.messages.training import TrainParams
from shared.task_graphs import TaskState


def _body(**fields: object) -> bytes:
    return msgspec.json.encode({"model": "demo", "training_file": "file-1", **fields})


class TestRequests:
    def test_hyperparameters_at_the_top_or_in_the_method(self):
        _, hp = parse_job_request(_body(hyperparameters={"n_epochs": 3}))
        assert (hp.n_epochs, hp.batch_size) == (3, "auto")
        method = {"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 2}}}
        _, hp = parse_job_request(_body(method=method))
        assert (hp.n_epochs, hp.batch_size) == ("auto", 2)
        with pytest.raises(BadRequest, match="not both"):
            parse_job_request(_body(method=method, hyperparameters={"n_epochs": 3}))

    @pytest.mark.parametrize(
        ("fields", "param"),
        [
            ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
            ({"hyperparameters": {"n_epochs": 1.5}}, "hyperparameters.n_epochs"),
            ({"hyperparameters": {"batch_size": "big"}}, "hyperparameters.batch_size"),
            ({"hyperparameters": {"learning_rate_multiplier": 0}}, None),
            ({"suffix": "has space"}, "suffix"),
            ({"suffix": "x" * 65}, "suffix"),
            ({"method": {"type": "dpo"}}, "method.type"),
            ({"seed": -1}, "seed"),
            ({"integrations": [{"type": "wandb"}]}, "integrations"),
            ({"metadata": {str(k): "v" for k in range(17)}}, "metadata"),
        ],
    )
    def test_bad_fields_are_400s_naming_them(self, fields, param):
        with pytest.raises(BadRequest) as e:
            parse_job_request(_body(**fields))
        if param:
            assert e.value.param == param

    def test_missing_training_file(self):
        with pytest.raises(BadRequest) as e:
            parse_job_request(msgspec.json.encode({"model": "demo"}))
        assert e.value.param == "training_file"


class TestPlan:
    def test_stages_run_in_order_and_the_graph_is_durable(self):
        graph = plan_fine_tune(job_id="ftjob-1", model="demo", deadline=1e12)
        assert [t.name for t in graph.tasks] == ["preprocess", "train", "evaluate"]
        assert durable(graph)
        assert [t.name for t in ready(graph)] == ["preprocess"]
        graph = with_task(graph, "preprocess", state=TaskState.PLACED, te_id="te-1")
        assert ready(graph) == []  # preprocess does not stream: train waits for it to end
        graph = with_task(graph, "preprocess", state=TaskState.DONE)
        assert [t.name for t in ready(graph)] == ["train"]

    def test_a_taken_over_graph_runs_again_what_may_still_run(self):
        graph = plan_fine_tune(job_id="ftjob-1", model="demo", deadline=1e12)
        graph = with_task(graph, "preprocess", state=TaskState.DONE)
        graph = with_task(graph, "train", state=TaskState.PLACED, te_id="te-1", attempt=2)
        again, stray = resumed(graph)
        assert [(t.name, t.te_id, t.attempt) for t in stray] == [("train", "te-1", 2)]
        train = again.task("train")
        assert (train.state, train.te_id, train.attempt) == (TaskState.PLANNED, "", 2)
        assert [t.name for t in ready(again)] == ["train"]


def _te(te_id: str, state: TEState = TEState.IDLE, cached: tuple[str, ...] = ()) -> TEHeartbeat:
    return TEHeartbeat(
        te_id=te_id,
        pool_id="p",
        host="h",
        pid=1,
        state=state,
        started_at=0,
        cached_weights={m: CachedWeights(1, 1) for m in cached},
    )


class TestPlacement:
    def test_an_idle_te_whose_host_caches_the_model_first(self):
        tes = [_te("a"), _te("b", cached=("demo",)), _te("c", TEState.READY, ("demo",))]
        assert training_te(tes, "demo", frozenset()) == "b"
        assert training_te(tes, "demo", frozenset({"b"})) == "a"
        assert training_te(tes, "other", frozenset()) == "a"
        assert training_te([_te("x", TEState.TRAINING)], "demo", frozenset()) is None

    def test_auto_is_zero_until_preprocess_resolves_it(self):
        job = FineTuneJob(
            id="ftjob-1",
            tenant="t",
            model="demo",
            training_file="f",
            created_at=0,
            seed=5,
            hyperparameters=Hyperparameters(n_epochs=4, learning_rate_multiplier=2.0),
        )
        p = asked_params(job, rank=8)
        assert (p.n_epochs, p.batch_size, p.learning_rate, p.rank, p.alpha, p.seed) == (
            4,
            0,
            4e-4,
            8,
            16,
            5,
        )
        resolved = auto_params(p, examples=200)
        assert (resolved.n_epochs, resolved.batch_size, resolved.learning_rate) == (4, 8, 4e-4)
        small = auto_params(TrainParams(), examples=10)
        assert (small.n_epochs, small.batch_size) == (10, 1)


def test_names_and_pages():
    assert fine_tuned_name("demo", "mine", "ftjob-abc") == "ft:demo:mine:abc"
    assert fine_tuned_name("demo", "", "ftjob-abc") == "ft:demo::abc"  # OpenAI's form

    class Item(msgspec.Struct):
        id: str

    items = [Item(str(i)) for i in range(5)]
    assert page(items, after=None, limit=2) == ([Item("0"), Item("1")], True)
    assert page(items, after="2", limit=5) == ([Item("3"), Item("4")], False)
    assert page(items, after="gone", limit=5) == ([], False)

"""Settings from the environment and TOML; message encoding."""

from datetime import timedelta

import pytest
from pydantic import ValidationError

from shared.messages.api import SamplingParams
from shared.messages.base import decoder_for, encode
from shared.messages.cluster import ClusterView, TEHeartbeat, TEState
from shared.messages.tasks import ChatTask, TokenChunk
from shared.settings import Settings, process_environment, turn_spin_environment
from shared.subjects import Keys, Subjects


def test_settings_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MESHSERVE_CLUSTER", "blue")
    monkeypatch.setenv("MESHSERVE_NATS_URL", "nats://n:4222")
    monkeypatch.setenv("MESHSERVE_REDIS_URL", "redis://r:6379")
    monkeypatch.setenv("MESHSERVE_MODELS_DIR", str(tmp_path))
    monkeypatch.setenv("MESHSERVE_HTTP_PORT", "9000")
    monkeypatch.setenv("MESHSERVE_KEEP_ALIVE", "2.5")
    monkeypatch.setenv("MESHSERVE_VLLM_ENFORCE_EAGER", "true")
    monkeypatch.setenv("CC", "clang")
    s = Settings.load()
    assert (s.cluster, s.nats_url, s.redis_url, s.frontend.http_port) == (
        "blue",
        "nats://n:4222",
        "redis://r:6379",
        9000,
    )
    assert s.models_dir == tmp_path and s.scaler.keep_alive == timedelta(seconds=2.5)
    assert s.vllm.enforce_eager and s.torch.cc == "clang"
    # Constructing settings reads nothing from the environment: only load() does.
    assert Settings().cluster == "default"


def test_an_empty_variable_leaves_an_optional_setting_unset():
    # compose.yaml passes `${MESHSERVE_ADMIN_KEY:-}`: empty must not become a key of "".
    s = Settings.load({"MESHSERVE_ADMIN_KEY": "", "MESHSERVE_NATS_URL": ""})
    assert s.auth.admin_key is None and s.nats_url is None
    with pytest.raises(ValidationError):
        Settings.load({"MESHSERVE_HTTP_PORT": ""})


def test_settings_env_round_trip_to_a_child():
    s = Settings(
        cluster="c1",
        keep_alive=timedelta(seconds=3),
        pool_size=4,
        model_engines={"demo": "torch", "big": "vllm"},
        nats_url="nats://x:1",
        max_prefill_tokens=64,
        model_scaling={"demo": {"min_replicas": 2, "keep_alive": 30}, "big": {"max_replicas": 3}},
    )
    assert Settings.load(s.env()) == s
    assert s.scaler.model_scaling["demo"].keep_alive == timedelta(seconds=30)


def test_tes_taking_turns_spin_briefly_unless_the_user_tuned_openmp(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    te = Settings.load().task_executor
    spin = turn_spin_environment(te)
    assert spin == {"GOMP_SPINCOUNT": "10000"}
    assert turn_spin_environment(te.model_copy(update={"turn_spin_count": 0})) == {}
    monkeypatch.setenv("GOMP_SPINCOUNT", "500")  # the user's own: kept
    assert turn_spin_environment(te) == {}
    assert process_environment(turn_spin_environment(te))["GOMP_SPINCOUNT"] == "500"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # a policy of the user's: no count
    assert turn_spin_environment(te) == {}


def test_settings_toml_file_and_env_precedence(monkeypatch, tmp_path):
    cfg = tmp_path / "meshserve.toml"
    cfg.write_text(
        '[meshserve]\ncluster = "from-file"\npool_size = 5\nkeep_alive = 4\n'
        "[meshserve.torch]\ncuda_graphs = false\n"
        "[meshserve.scaler]\nkeep_alive = 9\n"
    )
    monkeypatch.setenv("MESHSERVE_CONFIG", str(cfg))
    monkeypatch.setenv("MESHSERVE_POOL_SIZE", "7")
    s = Settings.load()
    assert s.cluster == "from-file" and s.task_executor.pool_size == 7
    assert not s.torch.cuda_graphs and s.scaler.keep_alive == timedelta(seconds=9)
    assert Settings.load(pool_size=1).task_executor.pool_size == 1  # given values win


def test_flat_and_nested_names_are_one_setting():
    flat = Settings(http_port=9001, vllm_python="/v/bin/python", log_level="debug")
    nested = Settings(
        frontend={"http_port": 9001}, vllm={"python": "/v/bin/python"}, log={"level": "debug"}
    )
    assert flat == nested
    assert flat.with_values(http_port=9002).frontend.http_port == 9002
    assert flat.frontend.http_port == 9001  # frozen: with_values copies


@pytest.mark.parametrize(
    "var,value",
    [
        ("MESHSERVE_CLUSTER", "a.b"),
        ("MESHSERVE_HTTP_PORT", "70000"),
        ("MESHSERVE_ENGINE", "tensorrt"),
        ("MESHSERVE_MODEL_ENGINES", '{"demo": "tensorrt"}'),
    ],
)
def test_invalid_settings_are_rejected(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValidationError):
        Settings.load()


def test_unknown_names_are_rejected():
    with pytest.raises(ValidationError):
        Settings(http_prot=80)


def test_every_subject_and_key_carries_the_cluster_name():
    s, k = Subjects("c9"), Keys("c9")
    for subj in (
        s.job_submit(),
        s.te_task("t"),
        s.te_control("t"),
        s.token_stream("f", "r"),
        s.heartbeat(),
        s.view(),
        s.get_view(),
        s.traffic(),
        s.outcomes(),
        s.scale_events(),
    ):
        assert subj.startswith("c9.")
    assert k.models().startswith("c9:")


def test_tagged_union_decoding_and_defaults():
    task = ChatTask(
        request_id="r",
        model="m",
        prompt_token_ids=[1, 2],
        sampling=SamplingParams(max_tokens=4, seed=3),
        reply_to="x",
        deadline=1.0,
    )
    chunk = TokenChunk(request_id="r", seq=0, token_ids=[5])
    dec = decoder_for(ChatTask, TokenChunk)
    assert dec.decode(encode(task)) == task
    assert dec.decode(encode(chunk)) == chunk
    assert decoder_for(ChatTask).decode(encode(task)).sampling.temperature == 1.0


def test_old_readers_ignore_new_fields():
    """A message from a newer sender (an extra field) still decodes on an older reader."""

    class TEHeartbeatV2(TEHeartbeat, tag="TEHeartbeat"):
        gpu_util: float = 0.5

    new = TEHeartbeatV2(te_id="t", pool_id="p", host="h", pid=1, state=TEState.IDLE, started_at=0)
    old = decoder_for(TEHeartbeat).decode(encode(new))
    assert old.te_id == "t"


def test_view_round_trip():
    v = ClusterView(
        cluster="c",
        version=3,
        generated_at=1.0,
        tes=[
            TEHeartbeat(
                te_id="t",
                pool_id="p",
                host="h",
                pid=1,
                state=TEState.READY,
                started_at=0,
                model="m",
            )
        ],
    )
    assert decoder_for(ClusterView).decode(encode(v)) == v

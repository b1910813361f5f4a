"""The scaler service and `meshserve-loadgen simulate` run one glue path: the same settings
give the same policy configuration, and each simulated tick's decisions are those the
service's code path makes on the same inputs."""

from __future__ import annotations

import copy
import json

import pytest

from loadgen import simulator
from loadgen.plan import plan
from loadgen.simulator import SimConfig, simulate
from services.scaler.service import Scaler
from services.scaler.tick import Tick, tick
from shared.settings import ModelScaling, Settings
from shared.slo import SLO
from tests.unit.test_loadgen_simulator import profile, trace

# A deployment's environment, and the simulator's options that say the same.
ENV = {
    "MESHSERVE_KEEP_ALIVE": "5",
    "MESHSERVE_MIN_REPLICAS": "0",
    "MESHSERVE_MAX_REPLICAS": "3",
    "MESHSERVE_TARGET_UTILIZATION": "0.5",
    "MESHSERVE_MODEL_SCALING": json.dumps({"b": {"max_replicas": 1, "keep_alive": 2}}),
    "MESHSERVE_STABLE_WINDOW": "10",
    "MESHSERVE_PANIC_WINDOW": "2",
    "MESHSERVE_PRELOAD_WINDOW": "30",
    "MESHSERVE_SLO_TTFT": "1",
    "MESHSERVE_SLO_TPOT": "0.1",
    "MESHSERVE_SLO_TARGET": "0.9",
}
SIM = SimConfig(
    devices=4,
    pool_size=2,
    keep_alive_s=5.0,
    min_replicas=0,
    max_replicas=3,
    target_utilization=0.5,
    model_scaling={"b": ModelScaling(max_replicas=1, keep_alive=2)},
    stable_window_s=10.0,
    panic_window_s=2.0,
    preload_window_s=30.0,
    slo=SLO(ttft_s=1.0, tpot_s=0.1),
    slo_target=0.9,
    network_s=0.0,
)


def _service_scaler() -> Scaler:
    """The scaler service as `meshserve up` builds it from that environment (its bus is
    never used: only its decision path runs here)."""
    return Scaler(settings=Settings.load(ENV), bus=None)  # type: ignore[arg-type]


def test_the_simulator_configures_the_policy_as_the_service_does() -> None:
    assert SIM.scaler_config() == _service_scaler()._cfg


def test_each_simulated_tick_decides_as_the_service_would(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[dict, Tick]] = []

    def recording(state, tes, **kw) -> Tick:  # type: ignore[no-untyped-def]
        args = copy.deepcopy({"state": state, "tes": list(tes), **kw})
        out = tick(state, tes, **kw)
        calls.append((args, out))
        return out

    monkeypatch.setattr(simulator, "tick", recording)
    # Two models: a burst that scales a out, b capped at one instance, then quiet (scale in).
    reqs = trace(*[(0.2 * i, 200, 40) for i in range(40)], model="a")
    reqs += trace(*[(1.0 + 0.5 * i, 100, 20) for i in range(10)], model="b")
    reqs.sort(key=lambda r: r.arrival_s)
    results, stats = simulate(plan(reqs), {"a": profile("a"), "b": profile("b")}, SIM)
    assert all(r.ok for r in results) and stats.loads >= 3
    assert any(out.decision.actions for _, out in calls)

    scaler = _service_scaler()
    for args, out in calls:
        kept = copy.deepcopy(args)
        again = tick(
            args["state"],
            args["tes"],
            models=args["models"],
            now=args["now"],
            cfg=scaler._cfg,
            tried=args["tried"],
        )
        assert again == out
        assert args == kept  # pure: nothing it was given changed

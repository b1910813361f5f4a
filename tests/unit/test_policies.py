"""The pure policy functions: placement, scaling, membership."""

from services.cluster_manager.membership import expired, identity
from services.job_executor.scheduling import pick_te
from services.scaler.policy import Load, ScalerConfig, Unload, decide, load_backoff
from shared.messages.cluster import TEHeartbeat, TEState


def te(te_id, state=TEState.READY, model="m", running=0, waiting=0, pool="p1", last_active=0.0):
    return TEHeartbeat(
        te_id=te_id,
        pool_id=pool,
        host="h",
        pid=1,
        state=state,
        started_at=0,
        model=model,
        running=running,
        waiting=waiting,
        last_active=last_active,
    )


class TestPickTE:
    def test_least_loaded_ready_te_of_the_model(self):
        tes = [te("a", running=3), te("b", running=1, waiting=1), te("c", model="other")]
        assert pick_te("m", tes, {}).te_id == "b"

    def test_counts_placements_the_te_has_not_reported_yet(self):
        tes = [te("a", running=1), te("b", running=0)]
        assert pick_te("m", tes, {"b": 2}).te_id == "a"

    def test_ties_break_by_id_so_the_choice_is_deterministic(self):
        assert pick_te("m", [te("b"), te("a")], {}).te_id == "a"

    def test_skips_excluded_loading_and_draining(self):
        tes = [te("a"), te("b", state=TEState.DRAINING), te("c", state=TEState.LOADING)]
        assert pick_te("m", tes, {}, exclude={"a"}).te_id is None

    def test_asks_for_scale_up_only_when_nothing_is_loading(self):
        assert pick_te("m", [te("x", state=TEState.IDLE, model=None)], {}).scale_up
        assert not pick_te("m", [te("c", state=TEState.LOADING)], {}).scale_up


class TestScaler:
    cfg = ScalerConfig(keep_alive_s=60, demand_ttl_s=10)

    def test_scale_from_zero_takes_an_idle_te_from_the_roomiest_pool(self):
        tes = [
            te("a1", TEState.IDLE, None, pool="A"),
            te("b1", TEState.IDLE, None, pool="B"),
            te("b2", TEState.IDLE, None, pool="B"),
        ]
        acts = decide(tes, {"m": 100.0}, {}, now=101.0, cfg=self.cfg)
        assert acts == [Load(te_id="b2", model="m")]

    def test_no_second_load_while_one_is_loading_or_pending(self):
        idle = te("i", TEState.IDLE, None)
        assert (
            decide([idle, te("l", TEState.LOADING)], {"m": 100.0}, {}, now=100, cfg=self.cfg) == []
        )
        assert decide([idle], {"m": 100.0}, {"i": "m"}, now=100, cfg=self.cfg) == []

    def test_stale_demand_is_ignored(self):
        idle = te("i", TEState.IDLE, None)
        assert decide([idle], {"m": 0.0}, {}, now=100, cfg=self.cfg) == []

    def test_two_models_get_two_tes_and_a_third_waits(self):
        tes = [te("i1", TEState.IDLE, None), te("i2", TEState.IDLE, None)]
        acts = decide(tes, {"a": 5.0, "b": 5.0, "c": 5.0}, {}, now=5, cfg=self.cfg)
        assert sorted(a.model for a in acts) == ["a", "b"]
        assert len({a.te_id for a in acts}) == 2

    def test_scale_to_zero_after_keep_alive(self):
        idle_long = te("a", last_active=0.0)
        busy = te("b", running=1, last_active=0.0)
        recent = te("c", model="n", last_active=50.0)
        acts = decide([idle_long, busy, recent], {}, {}, now=100, cfg=self.cfg)
        assert acts == [Unload(te_id="a", model="m")]

    def test_failed_loads_back_off_exponentially(self):
        idle = te("i", TEState.IDLE, None)
        once = {"m": (1, 100.0)}
        assert decide([idle], {"m": 100.5}, {}, now=101.0, cfg=self.cfg, failed=once) == []
        assert decide([idle], {"m": 102.5}, {}, now=102.5, cfg=self.cfg, failed=once) != []
        thrice = {"m": (3, 100.0)}
        assert load_backoff(3, self.cfg) == 8.0
        assert decide([idle], {"m": 107.0}, {}, now=107.0, cfg=self.cfg, failed=thrice) == []
        assert load_backoff(30, self.cfg) == 60.0

    def test_recent_demand_keeps_a_model_alive(self):
        acts = decide([te("a", last_active=0.0)], {"m": 90.0}, {}, now=100, cfg=self.cfg)
        assert acts == []


class TestMembership:
    def test_expired_after_timeout(self):
        assert expired({"a": 10.0, "b": 14.5}, now=15.5, timeout=5) == ["a"]

    def test_load_changes_are_not_identity_changes(self):
        assert identity(te("a", running=0)) == identity(te("a", running=5))
        assert identity(te("a")) != identity(te("a", state=TEState.DRAINING))

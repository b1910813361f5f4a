"""The pure policy functions: placement, holding, membership (scaling: test_scaler_policy)."""

import dataclasses

from services.cluster_manager.membership import expired, identity
from services.job_executor.holding import GiveUp, Hold, PendingJob, PlaceOn, next_step
from services.job_executor.placement import Request, pick_te
from services.views import TEView, te_view
from shared.messages.cluster import JobShare, TEHeartbeat, TEState
from shared.messages.scaling import InstanceCapacity


def te(te_id, state=TEState.READY, model="m", running=0, waiting=0, pool="p1") -> TEView:
    return te_view(hb(te_id, state, model, running, waiting, pool))


def hb(te_id, state=TEState.READY, model="m", running=0, waiting=0, pool="p1", last_active=0.0):
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
        # Prompt tokens placed since the TE's report count like tokens it reported queued.
        tes = [te("a", running=1), te("b", running=0)]
        assert pick_te("m", tes, {"b": JobShare(prefill_tokens=20)}).te_id == "b"
        assert pick_te("m", tes, {"b": JobShare(prefill_tokens=100)}).te_id == "a"
        # Started decoding since: its prompt is no longer queued work, its decode is.
        started = {"b": JobShare(prefill_tokens=-100, decoding=1)}
        b = dataclasses.replace(te("b"), queued_prompt_tokens=100)
        assert pick_te("m", [te("a", running=2), b], {}).te_id == "a"  # 64 tokens < 100
        assert pick_te("m", [te("a", running=2), b], started).te_id == "b"  # 64 > 32

    def test_load_is_tokens_not_requests(self):
        long = dataclasses.replace(te("a", waiting=1), queued_prompt_tokens=4000)
        short = dataclasses.replace(te("b", running=3, waiting=2), queued_prompt_tokens=80)
        assert pick_te("m", [long, short], {}).te_id == "b"

    def test_a_prompt_goes_where_its_kv_fits(self):
        # a: idle but its KV nearly full (long requests decoding); b: busier, with room.
        def kv(te_id, free_blocks, running=0):
            h = hb(te_id, running=running)
            h.free_kv_blocks, h.total_kv_blocks, h.kv_block_size = free_blocks, 2730, 16
            return te_view(h)

        a, b = kv("a", free_blocks=100), kv("b", free_blocks=2000, running=3)
        assert a.kv_free_tokens == 1600
        assert pick_te("m", [a, b], {}, request=Request(prompt_tokens=1000)).te_id == "a"
        assert pick_te("m", [a, b], {}, request=Request(prompt_tokens=8000)).te_id == "b"
        # What it holds of the prompt needs no room; prompts queued there will take some.
        held = Request(prompt_tokens=8000, cached_tokens={"a": 7000})
        assert pick_te("m", [a, b], {}, request=held).te_id == "a"
        queued = {"a": JobShare(prefill_tokens=1000)}
        assert pick_te("m", [a, b], queued, request=held).te_id == "b"
        # KV on its way to b from a prefill TE (PD) takes its room too.
        incoming = {"b": JobShare(import_tokens=30000)}
        assert pick_te("m", [a, b], incoming, request=Request(prompt_tokens=8000)).te_id == "a"
        # Where no engine has the room, load decides as before; an engine that does not say
        # (vLLM) is never ruled out.
        huge = Request(prompt_tokens=40000)
        assert pick_te("m", [a, b], {}, request=huge).te_id == "a"
        assert te("c").kv_free_tokens is None
        assert pick_te("m", [a, b, te("c", running=1)], {}, request=huge).te_id == "c"

    def test_a_preempted_request_goes_where_its_preemption_validated_it(self):
        # b is busier, but the preemption that handed the request back validated it there.
        tes = [te("a"), te("b", running=3), te("c", state=TEState.LOADING), te("d", model="x")]
        moved = Request(prompt_tokens=100, prefer="b")
        chosen = pick_te("m", tes, {}, request=moved)
        assert (chosen.te_id, chosen.branch) == ("b", "validated")
        # Gone from the view, excluded (it refused), not ready or another model's: routing
        # chooses as for any request.
        for prefer in ("gone", "c", "d"):
            chosen = pick_te("m", tes, {}, request=Request(prompt_tokens=100, prefer=prefer))
            assert (chosen.te_id, chosen.branch) == ("a", "load"), prefer
        chosen = pick_te("m", tes, {}, exclude={"b"}, request=moved)
        assert (chosen.te_id, chosen.branch) == ("a", "load")

    def test_ties_break_by_id_so_the_choice_is_deterministic(self):
        assert pick_te("m", [te("b"), te("a")], {}).te_id == "a"

    def test_skips_excluded_loading_and_draining(self):
        tes = [te("a"), te("b", state=TEState.DRAINING), te("c", state=TEState.LOADING)]
        assert pick_te("m", tes, {}, exclude={"a"}).te_id is None

    def test_an_adapter_goes_to_a_lora_te_preferring_one_that_holds_it(self):
        def lora(te_id, running=0, adapters=()):
            return dataclasses.replace(
                te(te_id, running=running), lora=True, adapters=frozenset(adapters)
            )

        plain, holder, other = te("a"), lora("b", running=2, adapters={"x"}), lora("c")
        ask = Request(prompt_tokens=16, adapter="x")
        # Only engines that serve adapters; the one holding it though 2 decodes (64) busier.
        assert pick_te("m", [plain, holder, other], {}, request=ask).te_id == "b"
        # Much busier than loading the adapter elsewhere costs: the other LoRA TE.
        busy = dataclasses.replace(holder, queued_prompt_tokens=400)
        assert pick_te("m", [plain, busy, other], {}, request=ask).te_id == "c"
        # No LoRA TE at all: none (the job is held), and the base model goes anywhere.
        assert pick_te("m", [plain], {}, request=ask).te_id is None
        assert pick_te("m", [plain, holder], {}, request=Request(prompt_tokens=16)).te_id == "a"

    def test_while_an_instance_loads_a_ready_te_takes_only_what_it_starts_in_time(self):
        # 10,000 prompt tokens a second: a 4,000-token prompt takes 0.4 s alone.
        cap = InstanceCapacity(
            prefill_s=1e-4,
            prefill_attention_s=0.0,
            decode_s=1e-3,
            decode_context_s=0.0,
            max_num_seqs=8,
        )

        def ready(te_id, queued):
            return dataclasses.replace(te(te_id), capacity=cap, queued_prompt_tokens=queued)

        loading = te("c", state=TEState.LOADING)
        ask = Request(prompt_tokens=4000, ttft_left_s=1.0)
        # a's queue (5,000 tokens) and the prompt: 0.9 s, in time; b's (7,000): 1.1 s.
        assert pick_te("m", [ready("a", 5000), loading], {}, request=ask).te_id == "a"
        held = pick_te("m", [ready("b", 7000), loading], {}, request=ask)
        assert (held.te_id, held.scale_up) == (None, False)
        # Unplaced jobs this JE put there count: one more 4,000-token prompt makes a late.
        more = {"a": JobShare(prefill_tokens=4000)}
        assert pick_te("m", [ready("a", 5000), loading], more, request=ask).te_id is None
        # Where a cached prefix spares the prefill, in time again.
        cached = dataclasses.replace(ask, cached_tokens={"b": 3000})
        assert pick_te("m", [ready("b", 7000), loading], {}, request=cached).te_id == "b"
        # Among several, routing chooses among those in time.
        assert (
            pick_te("m", [ready("a", 5000), ready("b", 7000), loading], {}, request=ask).te_id
            == "a"
        )
        # Nothing loading: late or not, routing chooses as before; no limit: as before too.
        assert pick_te("m", [ready("b", 7000)], {}, request=ask).te_id == "b"
        assert pick_te("m", [ready("b", 7000), loading], {}, request=Request(4000)).te_id == "b"
        # Late already: where routing says (it keeps no instance coming up from one in time).
        late = dataclasses.replace(ask, ttft_left_s=-0.1)
        assert pick_te("m", [ready("b", 7000), loading], {}, request=late).te_id == "b"
        # A TE whose capacity is unknown takes it (nothing to say it would be late).
        assert pick_te("m", [te("d", waiting=50), loading], {}, request=ask).te_id == "d"

    def test_asks_for_scale_up_only_when_nothing_is_loading(self):
        assert pick_te("m", [te("x", state=TEState.IDLE, model=None)], {}).scale_up
        assert not pick_te("m", [te("c", state=TEState.LOADING)], {}).scale_up


class TestHolding:
    job = PendingJob(model="m", deadline=100.0)

    def test_places_on_a_ready_te(self):
        assert next_step(self.job, [te("a")], {}, now=1.0) == PlaceOn("a")

    def test_holds_while_the_model_loads_and_asks_at_once_when_nothing_comes(self):
        assert next_step(self.job, [te("a", TEState.LOADING)], {}, now=1.0) == Hold(urgent=False)
        assert next_step(self.job, [te("x", TEState.IDLE, None)], {}, now=1.0) == Hold(urgent=True)

    def test_refusals_count_until_the_next_view_and_ask_for_capacity(self):
        job = PendingJob(model="m", deadline=100.0, refused=frozenset({"a"}))
        assert next_step(job, [te("a")], {}, now=1.0) == Hold(urgent=True)

    def test_a_te_the_job_left_is_a_last_resort(self):
        job = PendingJob(model="m", deadline=100.0, exclude=frozenset({"a"}))
        assert next_step(job, [te("a"), te("b", running=9)], {}, now=1.0) == PlaceOn("b")
        assert next_step(job, [te("a")], {}, now=1.0) == PlaceOn("a")

    def test_gives_up_at_the_deadline(self):
        assert next_step(self.job, [], {}, now=100.0) == GiveUp()


class TestMembership:
    def test_expired_after_timeout(self):
        assert expired({"a": 10.0, "b": 14.5}, now=15.5, timeout=5) == ["a"]

    def test_load_changes_are_not_identity_changes(self):
        assert identity(hb("a", running=0)) == identity(hb("a", running=5))
        assert identity(hb("a")) != identity(hb("a", state=TEState.DRAINING))

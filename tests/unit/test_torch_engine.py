"""Behaviour of the torch engine a TE would notice: continuous batching, sampling, stop rules,
abort, a full KV cache; and the scheduling policy as a pure function."""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from services.task_executor.engines.base import EngineOutput, EngineRequest
from services.task_executor.engines.torch_engine import TorchEngine
from services.task_executor.engines.torch_engine.config import load_model_config
from services.task_executor.engines.torch_engine.kv_cache import BlockAllocator, NoFreeBlocksError
from services.task_executor.engines.torch_engine.scheduler import (
    Pacing,
    SchedulerConfig,
    SeqView,
    pacing,
    prefill_budget,
    schedule,
    tpot_slack,
)
from shared.messages.api import SamplingParams
from tests.engines import TEST_DEVICE, drain, tokens

VOCAB = 96
EOS = 95


def _write_tiny_llama(out: Path, **overrides: object) -> Path:
    """A random Llama checkpoint written directly (no transformers import: fast)."""
    hidden, inter, heads, kv_heads, layers = 32, 64, 4, 2, 2
    hd = hidden // heads
    config = {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "eos_token_id": EOS,
        "torch_dtype": "float32",
        **overrides,
    }
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return 0.3 * torch.randn(shape, generator=gen)

    tensors = {
        "model.embed_tokens.weight": rnd(VOCAB, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
            p + "self_attn.k_proj.weight": rnd(kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": rnd(kv_heads * hd, hidden),
            p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
            p + "mlp.gate_proj.weight": rnd(inter, hidden),
            p + "mlp.up_proj.weight": rnd(inter, hidden),
            p + "mlp.down_proj.weight": rnd(hidden, inter),
        }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def _engine(model_dir: Path, **kwargs: object) -> TorchEngine:
    kwargs = {"device": TEST_DEVICE, "block_size": 4, "num_kv_blocks": 64} | kwargs
    return TorchEngine(model_dir, **kwargs)  # type: ignore[arg-type]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


PROMPTS = {
    "a": [5, 17, 42, 8, 61, 3, 29],
    "b": [11, 2],
    "c": [7, 70, 33, 12, 90, 45, 1, 18, 64, 23, 9],
}


def _run_alone(model_dir: Path, rid: str, params: SamplingParams) -> list[EngineOutput]:
    engine = _engine(model_dir)
    engine.add_request(EngineRequest(rid, PROMPTS[rid], params))
    return drain(engine)[rid]


# --- continuous batching -------------------------------------------------------------------


def test_request_joining_mid_generation_finishes_and_matches_running_alone(model_dir: Path) -> None:
    alone = {rid: tokens(_run_alone(model_dir, rid, greedy(12))) for rid in PROMPTS}

    engine = _engine(model_dir)
    engine.add_request(EngineRequest("a", PROMPTS["a"], greedy(12)))
    engine.add_request(EngineRequest("b", PROMPTS["b"], greedy(12)))
    outs: dict[str, list[EngineOutput]] = {}
    for _ in range(4):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert engine.stats().running == 2
    engine.add_request(EngineRequest("c", PROMPTS["c"], greedy(12)))
    joined = engine.step()
    assert {o.request_id for o in joined} == {"a", "b", "c"}  # c joined at the iteration boundary
    for o in joined:
        outs.setdefault(o.request_id, []).append(o)
    for rid, more in drain(engine).items():
        outs.setdefault(rid, []).extend(more)

    for rid in PROMPTS:
        assert tokens(outs[rid]) == alone[rid], rid
        assert outs[rid][-1].finished and outs[rid][-1].finish_reason == "length"
        assert all(o.num_prompt_tokens == len(PROMPTS[rid]) for o in outs[rid])
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks


LONG = [(7 * i + 3) % (VOCAB - 1) for i in range(50)]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_chunked_prefill_matches_a_whole_prefill_while_decodes_go_on(
    model_dir: Path, overlap: bool
) -> None:
    """A 50-token prompt under an 8-token budget computes over 7 iterations; a request already
    decoding gets a token in each of them, and both produce what they produce unchunked
    (greedy and seeded sampling: partial chunks take no draws)."""
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    ref = _engine(model_dir, chunked_prefill=False)
    ref.add_request(EngineRequest("long", LONG, seeded))
    ref.add_request(EngineRequest("a", PROMPTS["a"], greedy(12)))
    want = {rid: tokens(o) for rid, o in drain(ref).items()}

    engine = _engine(model_dir, max_prefill_tokens=8, overlap_on_cpu=overlap)
    engine.add_request(EngineRequest("a", PROMPTS["a"], greedy(12)))
    outs = {"a": list(engine.step())}
    engine.drain_kv_events()
    engine.add_request(EngineRequest("long", LONG, seeded))
    for i in range(7):
        step = engine.step()
        assert [o.request_id for o in step] == (["a"] if i < 6 else ["a", "long"]), i
        if i == 2:  # 24 tokens computed: their 6 full blocks are shareable already
            stored = [h for e in engine.drain_kv_events() for h in getattr(e, "block_hashes", [])]
            hashes = engine.block_hashes(LONG)
            assert set(hashes[:6]) <= set(stored) and hashes[6] not in stored
        for o in step:
            outs.setdefault(o.request_id, []).append(o)
    for rid, more in drain(engine).items():
        outs.setdefault(rid, []).extend(more)
    assert {rid: tokens(o) for rid, o in outs.items()} == want
    assert outs["long"][0].num_prompt_tokens == 50
    assert engine.stats().free_kv_blocks == engine.stats().total_kv_blocks


# --- sampling --------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_alone_or_batched(model_dir: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = tokens(_run_alone(model_dir, "a", params))
    assert tokens(_run_alone(model_dir, "a", params)) == alone

    engine = _engine(model_dir)
    engine.add_request(EngineRequest("b", PROMPTS["b"], SamplingParams(max_tokens=16, seed=7)))
    engine.add_request(EngineRequest("c", PROMPTS["c"], greedy(5)))
    engine.step()
    engine.add_request(EngineRequest("a", PROMPTS["a"], params))
    assert tokens(drain(engine)["a"]) == alone

    other_seed = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99, ignore_eos=True)
    assert tokens(_run_alone(model_dir, "a", other_seed)) != alone


def test_a_seeded_row_samples_the_same_token_whatever_shares_its_batch() -> None:
    # Rows with and without top_p used to share one code path per batch, so a row without
    # top_p next to one with it was sampled from sorted probabilities: another token for the
    # same draw.
    from services.task_executor.engines.torch_engine.sampling import make_generator, sample

    logits = 2 * torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    plain = SamplingParams(max_tokens=1, temperature=1.0)
    cut = SamplingParams(max_tokens=1, temperature=0.7, top_p=0.5)
    mates = [SamplingParams(max_tokens=1, temperature=0), cut]
    for seed in range(50):
        alone = sample(logits[:1], [plain], [make_generator(seed)])
        batched = sample(logits, [plain, *mates], [make_generator(seed)] + [make_generator(9)] * 2)
        assert batched[0] == alone[0], seed
        cut_alone = sample(logits[2:], [cut], [make_generator(seed)])
        gens = [make_generator(1), make_generator(2), make_generator(seed)]
        cut_batched = sample(logits, [plain, mates[0], cut], gens)
        assert cut_batched[2] == cut_alone[0], seed


def test_sampling_follows_the_distribution_and_top_p_cuts_its_tail() -> None:
    from services.task_executor.engines.torch_engine.sampling import make_generator, sample

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = make_generator(0)
    draws = [sample(logits, [SamplingParams(max_tokens=1)], [g])[0] for _ in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04)

    top = SamplingParams(max_tokens=1, top_p=0.7)
    assert set(sample(logits, [top], [g])[0] for _ in range(300)) == {0, 1}
    assert sample(logits, [SamplingParams(max_tokens=1, temperature=0)], [g]) == [0]


# --- stop rules ------------------------------------------------------------------------------


def test_max_tokens_finishes_with_length(model_dir: Path) -> None:
    outs = _run_alone(model_dir, "a", greedy(5))
    assert len(tokens(outs)) == 5
    assert [o.finished for o in outs] == [False] * 4 + [True]
    assert outs[-1].finish_reason == "length"


def _first_new_token(tokens: list[int]) -> int:
    """Index of the first token that did not occur before it (so stopping on it is unambiguous)."""
    return next(i for i, t in enumerate(tokens) if t not in tokens[:i] and i > 0)


def test_eos_finishes_with_stop_unless_ignored(model_dir: Path, tmp_path: Path) -> None:
    free_run = tokens(_run_alone(model_dir, "a", greedy(10)))
    i = _first_new_token(free_run)
    # Same weights, but the token greedy decoding reaches at step i is declared EOS, as a
    # list in generation_config.json (config.json's own eos is kept as well).
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    (eos_dir / "model.safetensors").symlink_to(model_dir / "model.safetensors")
    (eos_dir / "config.json").write_text((model_dir / "config.json").read_text())
    (eos_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [free_run[i]]}))
    assert load_model_config(eos_dir).eos_token_ids == {EOS, free_run[i]}

    engine = _engine(eos_dir)
    engine.add_request(
        EngineRequest("a", PROMPTS["a"], SamplingParams(max_tokens=10, temperature=0))
    )
    engine.add_request(EngineRequest("x", PROMPTS["a"], greedy(10)))  # ignore_eos
    outs = drain(engine)
    assert tokens(outs["a"]) == free_run[: i + 1]
    assert outs["a"][-1].finish_reason == "stop"
    assert tokens(outs["x"]) == free_run
    assert outs["x"][-1].finish_reason == "length"


def test_stop_token_ids_finish_with_stop(model_dir: Path) -> None:
    free_run = tokens(_run_alone(model_dir, "c", greedy(10)))
    i = _first_new_token(free_run)
    outs = _run_alone(model_dir, "c", greedy(10, stop_token_ids=[free_run[i]]))
    assert tokens(outs) == free_run[: i + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"


def test_generation_is_clipped_at_max_model_len(model_dir: Path) -> None:
    engine = _engine(model_dir, max_model_len=12)
    assert engine.max_model_len == 12
    engine.add_request(EngineRequest("a", PROMPTS["a"], greedy(100)))  # 7 prompt tokens
    outs = drain(engine)["a"]
    assert len(tokens(outs)) == 12 - 7
    assert outs[-1].finish_reason == "length"


def test_requests_the_engine_can_never_serve_are_rejected(model_dir: Path) -> None:
    engine = _engine(model_dir, max_model_len=12)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest("e", [], greedy(4)))
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request(EngineRequest("long", list(range(12)), greedy(4)))
    with pytest.raises(ValueError):
        engine.add_request(EngineRequest("vocab", [VOCAB], greedy(4)))
    with pytest.raises(ValueError):
        engine.add_request(EngineRequest("zero", [1], greedy(0)))
    engine.add_request(EngineRequest("ok", list(range(11)), greedy(4)))
    with pytest.raises(ValueError, match="already"):
        engine.add_request(EngineRequest("ok", [1], greedy(4)))
    assert engine.stats().waiting == 1


# --- abort and a full cache --------------------------------------------------------------


def test_abort_frees_blocks_of_running_and_waiting_requests(model_dir: Path) -> None:
    engine = _engine(model_dir, max_num_seqs=1)
    total = engine.stats().total_kv_blocks
    engine.add_request(EngineRequest("a", PROMPTS["a"], greedy(20)))
    engine.add_request(EngineRequest("b", PROMPTS["b"], greedy(20)))
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert (stats.running, stats.waiting) == (1, 1)
    assert stats.free_kv_blocks < total

    engine.abort("a")
    engine.abort("unknown")  # ignored
    assert engine.stats().free_kv_blocks == total
    assert [o.request_id for o in engine.step()] == ["b"]  # b takes the freed slot
    engine.abort("b")
    assert not engine.has_work()
    assert engine.stats().free_kv_blocks == total
    assert engine.step() == []


@pytest.mark.parametrize("budget", [None, 3], ids=["default", "chunks-of-3"])
def test_full_cache_preempts_and_recomputes_without_changing_outputs(
    model_dir: Path, budget: int | None
) -> None:
    alone = {rid: tokens(_run_alone(model_dir, rid, greedy(14))) for rid in PROMPTS}
    # 10 blocks of 4 tokens: each request ends holding 4-7 blocks, so the three cannot all
    # stay resident; the newest is preempted and recomputed later (in chunks, with a budget
    # of 3 prompt tokens per iteration).
    engine = _engine(model_dir, num_kv_blocks=10, max_prefill_tokens=budget)
    for rid, prompt in PROMPTS.items():
        engine.add_request(EngineRequest(rid, prompt, greedy(14)))
    outs: dict[str, list[EngineOutput]] = {}
    saw_preemption = False
    for _ in range(200):
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        stats = engine.stats()
        saw_preemption |= stats.waiting > 0 and bool(outs.get("c") or outs.get("b"))
        assert stats.free_kv_blocks >= 0
    assert not engine.has_work()
    assert saw_preemption
    for rid in PROMPTS:
        assert tokens(outs[rid]) == alone[rid], rid
        assert outs[rid][-1].finish_reason == "length"
    assert engine.stats().free_kv_blocks == 10


def test_close_releases_the_engine(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.close()
    engine.close()
    with pytest.raises(RuntimeError):
        engine.step()


# --- scheduler policy (pure) -------------------------------------------------------------

CFG = SchedulerConfig(block_size=4, max_num_seqs=3, max_prefill_tokens=16, watermark_blocks=0)


def test_scheduler_admits_fcfs_within_seqs_budget_and_blocks() -> None:
    waiting = [SeqView("w1", 8), SeqView("w2", 8), SeqView("w3", 4)]
    d = schedule([], waiting, free_blocks=100, config=CFG)
    assert d.prefill == ("w1", "w2") and not d.preempt  # 16-token budget reached

    d = schedule([SeqView("r1", 9, 3)], waiting, free_blocks=100, config=CFG)
    assert d.running == ("r1",) and d.prefill == ("w1", "w2")  # max_num_seqs = 3

    d = schedule([], waiting, free_blocks=3, config=CFG)
    assert d.prefill == ("w1",)  # w2 needs 2 more blocks; w3 must not jump the queue

    d = schedule([], [SeqView("huge", 40), SeqView("w", 4)], free_blocks=100, config=CFG)
    assert d.prefill == ("huge",)  # over budget but first: it would never start otherwise


def test_scheduler_keeps_the_watermark_only_for_running_requests() -> None:
    cfg = SchedulerConfig(block_size=4, max_num_seqs=8, max_prefill_tokens=100, watermark_blocks=2)
    assert schedule([], [SeqView("w", 16)], free_blocks=4, config=cfg).prefill == ("w",)
    d = schedule([SeqView("r", 8, 2)], [SeqView("w", 8)], free_blocks=3, config=cfg)
    assert d.running == ("r",) and d.prefill == ()


def test_scheduler_preempts_the_newest_running_request_when_blocks_run_out() -> None:
    # Each running request crosses a block boundary with its next token and needs one block.
    running = [SeqView("old", 9, 2), SeqView("mid", 5, 1), SeqView("new", 13, 3)]
    d = schedule(running, [SeqView("w", 4)], free_blocks=2, config=CFG)
    assert d.preempt == ("new",)
    assert d.running == ("old", "mid")
    assert d.prefill == ()  # nothing joins while the cache is short

    # Preempting the newest is not always enough: it goes on until the rest fit.
    running = [SeqView("old", 9, 2), SeqView("mid", 5, 1), SeqView("new", 2, 1)]
    d = schedule(running, [], free_blocks=0, config=CFG)
    assert d.preempt == ("new", "mid")
    assert d.running == ("old",)


def test_a_short_cache_preempts_the_request_with_the_most_headroom() -> None:
    """With deadlines known (LLM-Mesh), the victim is the running request that can best
    afford to start over, not the newest; the newest among equals, and the newest whenever
    one has no deadline."""
    running = [
        SeqView("old", 9, 2, headroom_s=5.0),
        SeqView("mid", 5, 1, headroom_s=0.5),
        SeqView("new", 13, 3, headroom_s=1.0),
    ]
    d = schedule(running, [], free_blocks=2, config=CFG)
    assert d.preempt == ("old",) and d.running == ("mid", "new")
    # Still short: the next most headroom goes too.
    small_old = [dataclasses.replace(running[0], num_tokens=5, num_blocks=1), *running[1:]]
    d = schedule(small_old, [], free_blocks=0, config=CFG)
    assert d.preempt == ("old", "new") and d.running == ("mid",)
    tied = [dataclasses.replace(v, headroom_s=1.0) for v in running]
    assert schedule(tied, [], free_blocks=2, config=CFG).preempt == ("new",)
    unknown = [*running[:2], dataclasses.replace(running[2], headroom_s=None)]
    assert schedule(unknown, [], free_blocks=2, config=CFG).preempt == ("new",)


CHUNKED = SchedulerConfig(
    block_size=4, max_num_seqs=4, max_prefill_tokens=10, watermark_blocks=0, chunked_prefill=True
)


def test_chunked_prefill_splits_prompts_at_the_budget_and_keeps_decodes_going() -> None:
    # A prompt longer than the budget joins with the part that fits.
    d = schedule([], [SeqView("long", 25), SeqView("w", 4)], free_blocks=100, config=CHUNKED)
    assert d.prefill == ("long",) and d.cache_len == {"long": 10}

    # Mid-way, it is a running request that goes on first; decodes run beside it, outside
    # the budget; what is left of the budget starts the next prompt.
    running = [SeqView("dec", 9, 3, 8), SeqView("long", 25, 3, 10)]
    d = schedule(running, [SeqView("w", 8)], free_blocks=100, config=CHUNKED)
    assert d.running == ("dec", "long") and d.prefill == ()
    assert d.cache_len == {"dec": 9, "long": 20}
    running = [SeqView("dec", 10, 3, 9), SeqView("long", 25, 5, 20)]
    d = schedule(running, [SeqView("w", 8), SeqView("x", 2)], free_blocks=100, config=CHUNKED)
    assert d.prefill == ("w",)  # and x waits behind it: the budget is spent
    assert d.cache_len == {"dec": 10, "long": 25, "w": 5}

    # Blocks are taken for the chunk only: 3 free blocks hold the first 10 tokens of a prompt
    # that needs 7.
    d = schedule([], [SeqView("long", 25)], free_blocks=3, config=CHUNKED)
    assert d.prefill == ("long",) and d.cache_len == {"long": 10}

    # Cached tokens cost no budget: 20 cached + a 10-token chunk.
    d = schedule([], [SeqView("c", 40, 5, num_cached_tokens=20)], free_blocks=100, config=CHUNKED)
    assert d.cache_len == {"c": 30}


def test_chunked_prefill_leaves_a_second_prompt_waiting_for_budget_but_not_preempted() -> None:
    cfg = dataclasses.replace(CHUNKED, max_prefill_tokens=8)
    running = [SeqView("a", 30, 2, 8), SeqView("b", 30, 1, 4)]
    d = schedule(running, [], free_blocks=100, config=cfg)
    assert d.running == ("a",) and d.cache_len == {"a": 16} and d.preempt == ()

    # Short of blocks, the newest goes back to waiting even if it was not to run now.
    d = schedule(running, [], free_blocks=1, config=cfg)
    assert d.preempt == ("b",) and d.running == ("a",)


def test_a_preempted_requests_budget_goes_to_the_prompt_holding_the_blocks() -> None:
    """A long prompt mid-way holds most of the cache; a recomputed request (due first) takes
    the budget and needs blocks that are not free: it goes back to waiting, and its budget
    goes to the long prompt, which progresses. (Before, the long prompt got no budget, the
    recomputed one was admitted again and preempted again: nothing ever ran.)"""
    cfg = dataclasses.replace(CHUNKED, max_prefill_tokens=8)
    long = SeqView("long", 60, 10, 40, ttft_left_s=5.0)
    again = SeqView("again", 30, 2, 8, ttft_left_s=-math.inf)  # recomputed, due first
    d = schedule([long, again], [], free_blocks=1, config=cfg)
    assert d.preempt == ("again",)
    assert d.running == ("long",) and d.cache_len == {"long": 48}


def test_without_chunked_prefill_a_long_prompt_runs_whole() -> None:
    d = schedule([], [SeqView("long", 25)], free_blocks=100, config=CFG)
    assert d.prefill == ("long",) and d.cache_len == {"long": 25}


# A 0.5B model on 2 CPU cores, roughly: a 50 ms decode step, 0.5 ms a prompt token; a 250 ms
# TPOT target, of which 0.8 (200 ms) an iteration may take beside a request just started.
PACE = Pacing(
    tpot_s=0.25,
    step_s=0.05,
    decode_context_s=1e-6,
    prefill_s=5e-4,
    prefill_attention_s=1e-7,
    floor=32,
    ceiling=4096,
)


def test_prefill_budget_is_the_ceiling_until_something_decodes_then_what_keeps_the_tpot() -> None:
    assert prefill_budget(PACE, [], 3000) == 4096  # a burst prefills at the full rate
    # 200 ms - 50 ms step - 2 x 1,000 context tokens x 1 us = 148 ms, at 0.5 ms + 0.1 ms a
    # token of a 1,000-token prompt: 246 tokens.
    assert prefill_budget(PACE, [1000, 1000], 1000) == 246
    # Longer prompts (attention) and longer contexts leave fewer; never under the floor.
    assert prefill_budget(PACE, [1000, 1000], 8000) < 246
    assert prefill_budget(PACE, [200_000], 1000) == 32
    assert prefill_budget(dataclasses.replace(PACE, tpot_s=12.5), [10], 10) == 4096
    # Decodes that ran under their target have slack, which a prompt may spend: 1 s of it
    # allows (0.8 s - 52 ms) / 0.6 ms = 1,246 tokens.
    assert prefill_budget(PACE, [1000, 1000], 1000, slack_s=1.0) == 1246
    # A request already late (no slack) leaves the floor.
    assert prefill_budget(PACE, [1000], 1000, slack_s=-0.5) == 32
    # After 10 tokens 55 ms apart, a request has 2.5 - 0.5 = 2 s of slack.
    assert tpot_slack(0.25, 10, 0.5) == pytest.approx(2.0)


def test_paced_schedule_sizes_chunks_by_what_decodes() -> None:
    cfg = dataclasses.replace(CHUNKED, max_prefill_tokens=10, pacing=PACE)
    # Nothing decodes: a long prompt joins whole up to the ceiling.
    d = schedule([], [SeqView("long", 6000)], free_blocks=10_000, config=cfg)
    assert d.cache_len == {"long": 4096}
    # A decode runs beside it: the chunk is what keeps the iteration within the TPOT target
    # (the rule's own figure for these lengths), whatever max_prefill_tokens says.
    running = [SeqView("dec", 1000, 250, 999), SeqView("long", 6000, 1024, 4096)]
    d = schedule(running, [], free_blocks=10_000, config=cfg)
    assert d.cache_len == {"dec": 1000, "long": 4096 + prefill_budget(PACE, [1000], 6000)}
    # A prompt still waiting behind a running one sees no more than what is left.
    running = [SeqView("dec", 1000, 250, 999)]
    d = schedule(running, [SeqView("a", 100), SeqView("b", 500)], free_blocks=10_000, config=cfg)
    budget = prefill_budget(PACE, [1000], 100)
    assert d.prefill == ("a", "b") and d.cache_len["b"] == budget - 100
    # Without chunked prefill there is nothing to pace.
    whole = dataclasses.replace(cfg, chunked_prefill=False)
    d = schedule(running, [SeqView("long", 6000)], free_blocks=10_000, config=whole)
    assert d.cache_len["long"] == 6000


def test_pacing_comes_from_the_measured_capacity() -> None:
    from shared.messages.scaling import InstanceCapacity

    cap = InstanceCapacity(
        prefill_s=5e-4,
        prefill_attention_s=1e-7,
        decode_s=0.05 / 8,
        decode_step_s=0.05,
        decode_context_s=1e-6,
        max_num_seqs=8,
    )
    p = pacing(cap, tpot_s=0.25, ceiling=4096)
    assert (p.step_s, p.prefill_s, p.ceiling, p.floor) == (0.05, 5e-4, 4096, 32)
    assert p.tpot_s == 0.25
    # A capacity stored before decode_step_s existed: the full batch's step from decode_s.
    old = InstanceCapacity(
        prefill_s=5e-4,
        prefill_attention_s=0,
        decode_s=0.05 / 8,
        decode_context_s=0,
        max_num_seqs=8,
    )
    assert pacing(old, tpot_s=0.25, ceiling=4096).step_s == pytest.approx(0.05)


def test_an_engine_paces_its_prefill_once_told_its_costs(model_dir: Path, monkeypatch) -> None:
    from services.task_executor.engines.capabilities import CapabilityError, bind_features
    from shared.messages.scaling import InstanceCapacity

    engine = _engine(model_dir, max_num_seqs=4)
    assert engine.capabilities.prefill_pacing and engine.prefill_budget.paced_tokens > 0
    assert bind_features(engine).prefill_pacing is engine
    prompt = [1 + i % 90 for i in range(100)]
    cap = InstanceCapacity(
        prefill_s=0.002,
        prefill_attention_s=0,
        decode_s=0.01,
        decode_step_s=0.04,
        decode_context_s=0,
        max_num_seqs=4,
    )
    # A TPOT target that leaves room for 40 prompt tokens beside a request that has its first
    # token only: (0.8 x 0.1515 s - 0.04 s) / 2 ms = 40.6. On a clock that does not move, its
    # second token banks another 0.1515 s of slack: 101 tokens may go next, the 60 left.
    monkeypatch.setattr(
        "services.task_executor.engines.torch_engine.engine.time.monotonic", lambda: 100.0
    )
    engine.pace_prefill(cap, 0.1515)
    engine.add_request(EngineRequest("dec", [3, 4, 5], greedy(30)))
    engine.step()  # its prompt, alone: then it decodes
    engine.add_request(EngineRequest("p", prompt, greedy(4)))
    chunks, outs = [], []
    while engine.has_work():
        before = {r.request_id: r.num_computed for r in engine._running}
        outs += [o for o in engine.step() if o.request_id == "p"]
        after = {r.request_id: r.num_computed for r in engine._running}
        if "p" in after and after["p"] <= len(prompt):
            chunks.append(after["p"] - before.get("p", 0))
    assert chunks[:2] == [40, 60]
    # Chunked as it was, the prompt's tokens are those of a whole prefill.
    alone = _engine(model_dir, max_prefill_tokens=128)
    alone.add_request(EngineRequest("p", prompt, greedy(4)))
    assert tokens(outs) == tokens(drain(alone)["p"])

    fixed = _engine(model_dir, max_prefill_tokens=16)
    assert not fixed.capabilities.prefill_pacing and fixed.prefill_budget.paced_tokens == 0
    with pytest.raises(CapabilityError):
        fixed.pace_prefill(cap, 0.15)


def test_an_evicted_request_is_the_one_with_the_most_headroom_and_its_output_is_unchanged(
    model_dir: Path, monkeypatch
) -> None:
    """A cache too small for its three requests (an under-estimated pool): the first to go
    back to waiting is the one whose deadline is furthest (the oldest here, which the
    newest-first rule would have kept), and every request's greedy tokens are those it
    produces alone."""
    from shared.messages.scaling import InstanceCapacity

    alone = {rid: tokens(_run_alone(model_dir, rid, greedy(14))) for rid in PROMPTS}
    monkeypatch.setattr(
        "services.task_executor.engines.torch_engine.engine.time.monotonic", lambda: 100.0
    )
    engine = _engine(model_dir, num_kv_blocks=10)
    cap = InstanceCapacity(
        prefill_s=0.001,
        prefill_attention_s=0,
        decode_s=0.01,
        decode_step_s=0.01,
        decode_context_s=0,
        max_num_seqs=4,
    )
    # First token due 1 s a prompt token after arrival: c (11 tokens) at 111, a (7) at 107,
    # b (2) at 102. c runs first, then the other two join: c is the oldest and has the most
    # headroom.
    engine.pace_prefill(cap, 0.5, ttft_s=0.5, ttft_per_token_s=1.0)
    engine.add_request(EngineRequest("c", PROMPTS["c"], greedy(14)))
    outs: dict[str, list[EngineOutput]] = {"c": list(engine.step())}
    for rid in ("a", "b"):
        engine.add_request(EngineRequest(rid, PROMPTS[rid], greedy(14)))
    evicted: list[str] = []
    for _ in range(200):
        if not engine.has_work():
            break
        before = {r.request_id for r in engine._running}
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        evicted += sorted(before & {r.request_id for r in engine._waiting})
    assert not engine.has_work()
    assert evicted and evicted[0] == "c", evicted
    for rid in PROMPTS:
        assert tokens(outs[rid]) == alone[rid], rid
    assert engine.stats().free_kv_blocks == 10


def test_scheduler_does_nothing_without_work() -> None:
    assert schedule([], [], free_blocks=10, config=CFG).idle


# --- block allocator -----------------------------------------------------------------------


def test_block_allocator_counts_owners() -> None:
    alloc = BlockAllocator(4)
    a = alloc.allocate(3)
    assert alloc.num_free == 1
    alloc.fork(a[:1])  # a second owner, as prefix sharing will add
    alloc.free(a)
    assert alloc.num_free == 3 and alloc.ref_count(a[0]) == 1
    alloc.free(a[:1])
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.free(a[:1])
    with pytest.raises(RuntimeError):
        alloc.allocate(5)


def test_block_allocator_hands_out_the_lowest_block_and_keeps_to_its_limit() -> None:
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    assert a == [0, 1, 2] and alloc.highest_in_use() == 2
    alloc.free([0])
    assert alloc.allocate(1) == [0]  # the lowest free, not the longest free
    alloc.set_limit(4)
    assert alloc.num_free == 1 and alloc.allocate(1) == [3]
    with pytest.raises(NoFreeBlocksError):
        alloc.allocate(1)
    with pytest.raises(ValueError):
        alloc.set_limit(3)  # block 3 is in use
    alloc.free([3, 2])
    alloc.set_limit(2)
    assert alloc.num_free == 0 and alloc.highest_in_use() == 1
    alloc.set_limit(8)
    assert alloc.num_free == 6 and alloc.allocate(6) == [2, 3, 4, 5, 6, 7]


def _written_blocks(t: torch.Tensor) -> int:
    """Blocks of a layer's K that hold anything but zeros."""
    return int((t.reshape(t.shape[0], -1) != 0).any(dim=1).sum())


def test_the_kv_pool_resizes_between_iterations_and_outputs_stay_the_same(
    model_dir: Path,
) -> None:
    """KV sized by demand (LLM-Mesh): grown and shrunk while requests run, greedy tokens
    are what the engine produces at a fixed size; a shrink never goes under the blocks in
    use, evicts cached prefixes above the new size, and gives the pages above it back (they
    read as zeros again)."""
    from services.task_executor.engines.capabilities import bind_features

    alone = {rid: tokens(_run_alone(model_dir, rid, greedy(14))) for rid in PROMPTS}
    engine = _engine(model_dir, device="cpu", num_kv_blocks=64)
    assert engine.capabilities.kv_resize and engine.kv_blocks == (64, 64)
    assert bind_features(engine).kv_resize is engine
    assert engine.resize_kv(12) == 12 and engine.stats().total_kv_blocks == 12
    for rid, prompt in PROMPTS.items():
        engine.add_request(EngineRequest(rid, prompt, greedy(14)))
    outs: dict[str, list[EngineOutput]] = {}
    sizes = []
    for i in range(200):
        if not engine.has_work():
            break
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        # Every few iterations a new size, down to 1 block (held at what is in use) and up.
        sizes.append(engine.resize_kv([40, 1, 20, 9][i % 4]))
        in_use = engine.cache.allocator.highest_in_use() + 1
        assert engine.kv_blocks[0] == sizes[-1] >= in_use
    assert min(sizes) < 20 and max(sizes) == 40
    for rid in PROMPTS:
        assert tokens(outs[rid]) == alone[rid], rid
    # Idle, nothing is in use: a shrink to 2 blocks evicts the prefixes cached above them
    # (the full blocks of the three runs again at full size), a grow brings blocks back empty.
    engine.resize_kv(64)
    for rid, prompt in PROMPTS.items():
        engine.add_request(EngineRequest(f"{rid}-again", prompt, greedy(14)))
    assert {rid: tokens(o) for rid, o in drain(engine).items()} == {
        f"{rid}-again": t for rid, t in alone.items()
    }
    held = [engine.held_prefix_tokens(p) for p in PROMPTS.values()]
    assert engine.resize_kv(2) == 2 and engine.stats().total_kv_blocks == 2
    assert engine.stats().free_kv_blocks == 2
    assert engine.resize_kv(64) == 64 and engine.stats().free_kv_blocks == 64
    assert sum(engine.held_prefix_tokens(p) for p in PROMPTS.values()) < sum(held)
    # Its memory goes back: with a block a page (64 tokens of this model), the three
    # requests' blocks are written, and after a shrink to one block all but the first read
    # as zeros again (fresh pages).
    engine = _engine(model_dir, device="cpu", num_kv_blocks=8, block_size=64)
    per_block = engine.cache.k[0][0].numel() * engine.cache.k[0].element_size()
    assert per_block == mmap.PAGESIZE
    for rid, prompt in PROMPTS.items():
        engine.add_request(EngineRequest(rid, prompt, greedy(14)))
    drain(engine)
    assert _written_blocks(engine.cache.k[0]) == 3
    assert engine.resize_kv(1) == 1
    assert _written_blocks(engine.cache.k[0]) == 1 and _written_blocks(engine.cache.v[1]) == 1


def test_a_tes_kv_pool_grows_at_once_and_shrinks_after_a_while(model_dir: Path) -> None:
    """``MESHSERVE_KV_SIZING``'s state and calls (``task_executor/kv_pool.py``) on a real
    engine: 256 blocks of 4 tokens, a 128-token context (the demand's floor)."""
    from services.task_executor.kv_pool import KvPlan, KvPool

    engine = _engine(model_dir, device="cpu", num_kv_blocks=256)
    pool = KvPool(engine, max_model_len=engine.max_model_len)
    assert engine.max_model_len == 128
    # Idle: 1,024 tokens against a demand of 128; shrunk to 128 × 1.25 only after 30 s.
    assert pool.plan([], now=0.0).blocks is None
    assert pool.plan([], now=29.0).blocks is None
    assert pool.plan([], now=30.0).blocks == 40
    assert pool.resize(40) == 40 and engine.stats().total_kv_blocks == 40
    # Two requests of 100 + 300 tokens: 800, grown at once to 1,000 tokens (250 blocks).
    held = [(100, 300), (100, 300)]
    assert pool.plan(held, now=31.0).blocks == 250
    pool.resize(250)
    # A demand that wobbles inside the band changes nothing.
    assert pool.plan([(100, 300), (100, 250)], now=32.0).blocks is None
    # One short request (its output taken as the mean, 256): 266 tokens × 1.25 = 333, and
    # 1,000 is over 1.5 times that: shrunk, but not before 30 s of it.
    assert pool.plan([(10, 10)], now=40.0).blocks is None
    assert pool.plan([(10, 10)], now=70.0).blocks == 84  # ceil(332.5 / 4) blocks
    assert pool.resize(84) == 84
    # Under a device budget: a grow goes as far as the arbiter's room and asks for the rest
    # (in bytes); a squeeze shrinks to the demand at once, band and delay ignored.
    bb = engine.kv_block_bytes
    assert bb == 2 * 2 * 4 * 2 * 8 * 4  # K and V, 2 layers, 4 tokens, 2 heads of 8, fp32
    grow = pool.plan(held, now=71.0, room_bytes=100 * bb)
    assert grow.blocks == 100 and grow.need_bytes == 250 * bb
    assert pool.plan(held, now=71.0, room_bytes=50 * bb) == KvPlan(None, 250 * bb)
    assert pool.plan(held, now=71.0, room_bytes=300 * bb) == KvPlan(250, None)
    pool.resize(250)
    assert pool.plan([(10, 300)], now=72.0).blocks is None  # in the band
    assert pool.plan([(10, 300)], now=72.0, squeeze=True) == KvPlan(97, None)  # 310 x 1.25
    # The mean output follows what finished requests produced.
    for _ in range(40):
        pool.finished(10)
    assert 10 < pool.mean_output < 15


# --- checkpoint config ---------------------------------------------------------------------


def test_config_reads_the_transformers_4_layout(tmp_path: Path) -> None:
    raw = {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,  # not hidden / heads
        "vocab_size": 100,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "sliding_window": 4096,
        "eos_token_id": [7, 8],
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    cfg = load_model_config(tmp_path)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.attention_bias) == (32, 1, False)
    assert (cfg.rope.type, cfg.rope.theta, cfg.rope.original_max_position_embeddings) == (
        "llama3",
        500000.0,
        8192,
    )
    assert cfg.eos_token_ids == {7, 8, 9}
    assert cfg.torch_dtype == "bfloat16"

    raw["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="rope"):
        load_model_config(tmp_path)


# --- prompts by deadline ------------------------------------------------------------------


def test_a_prompt_due_sooner_takes_the_budget_before_a_long_one_mid_way() -> None:
    cfg = dataclasses.replace(CHUNKED, max_prefill_tokens=10)
    # A long prompt mid-way (due in 30 s) and a short one just queued (due in 2 s).
    running = [SeqView("long", 40, 3, 10, ttft_left_s=30.0)]
    d = schedule(running, [SeqView("short", 6, ttft_left_s=2.0)], free_blocks=100, config=cfg)
    assert d.prefill == ("short",) and d.cache_len == {"short": 6, "long": 14}
    # Due later than the long one: it waits for what the long one leaves (nothing).
    d = schedule(running, [SeqView("later", 6, ttft_left_s=60.0)], free_blocks=100, config=cfg)
    assert d.prefill == () and d.cache_len == {"long": 20}
    # Without deadlines, as before: the running prompt first.
    d = schedule([SeqView("long", 40, 3, 10)], [SeqView("w", 6)], free_blocks=100, config=cfg)
    assert d.prefill == () and d.cache_len == {"long": 20}


def test_a_prompt_about_to_miss_its_deadline_spends_the_decodes_banked_slack() -> None:
    cfg = dataclasses.replace(CHUNKED, max_prefill_tokens=10, pacing=PACE)
    dec = SeqView("dec", 1000, 250, 999, tpot_slack_s=1.0)
    normal = prefill_budget(PACE, [1000], 3000, 1.0)  # (0.8 s - 51 ms) / 0.8 ms
    spent = prefill_budget(PACE, [1000], 3000, 1.0, urgent=True)  # (1 s - 51 ms) / 0.8 ms
    assert spent > normal
    # Time enough: the usual budget. 3,000 tokens in chunks of `normal` take 4 iterations of
    # about 0.8 s.
    relaxed = SeqView("p", 3000, ttft_left_s=60.0)
    d = schedule([dec], [relaxed], free_blocks=10_000, config=cfg)
    assert d.cache_len["p"] == normal
    # Due in 2 s: at that budget it would be late, so it takes the whole slack.
    hurried = SeqView("p", 3000, ttft_left_s=2.0)
    d = schedule([dec], [hurried], free_blocks=10_000, config=cfg)
    assert d.cache_len["p"] == spent
    # Already late: spending the decodes' slack would not save it.
    late = SeqView("p", 3000, ttft_left_s=-1.0)
    assert schedule([dec], [late], free_blocks=10_000, config=cfg).cache_len["p"] == normal


def test_a_prompt_late_by_less_than_the_yield_goes_behind_those_still_in_time() -> None:
    """EDF's domino effect: the latest request first makes the next ones late too. One late
    by less than ``late_yield_s`` (its SLO lost wherever it goes) waits behind every prompt
    still in time; one late by more, or preempted, keeps its place first."""
    from services.task_executor.engines.torch_engine.scheduler import admission_head

    # The queue in deadline order: (name, seconds left until its first token is due).
    queue = [("again", -math.inf), ("old", -9.0), ("late", -2.0), ("just", -0.1), ("a", 0.5)]
    queue += [("b", 2.0)]

    def names(items: list[tuple[str, float]]) -> list[str]:
        return [name for name, _ in items]

    def left(item: tuple[str, float]) -> float:
        return item[1]

    order = admission_head(queue, 10, left, late_yield_s=3.0)
    assert names(order) == ["again", "old", "a", "b", "late", "just"]
    assert names(admission_head(queue, 3, left, late_yield_s=3.0)) == ["again", "old", "a"]
    assert names(admission_head(queue, 10, left, late_yield_s=0.0)) == names(queue)  # EDF
    assert names(admission_head(queue, 10, left, late_yield_s=math.inf)) == [
        "again", "a", "b", "old", "late", "just"
    ]  # fmt: skip
    # The budget goes the same way: a prompt mid-way and late by 1 s waits for a waiting
    # one in time; by plain deadline order it would take the budget first.
    cfg = dataclasses.replace(CHUNKED, max_prefill_tokens=10, late_yield_s=3.0)
    running = [SeqView("late", 40, 3, 10, ttft_left_s=-1.0)]
    d = schedule(running, [SeqView("due", 6, ttft_left_s=2.0)], free_blocks=100, config=cfg)
    assert d.prefill == ("due",) and d.cache_len == {"due": 6, "late": 14}
    edf = dataclasses.replace(cfg, late_yield_s=0.0)
    d = schedule(running, [SeqView("due", 6, ttft_left_s=2.0)], free_blocks=100, config=edf)
    assert d.prefill == () and d.cache_len == {"late": 20}
    # Late by more than the bound: first again, nothing waits for ever.
    running = [SeqView("late", 40, 3, 10, ttft_left_s=-5.0)]
    d = schedule(running, [SeqView("due", 6, ttft_left_s=2.0)], free_blocks=100, config=cfg)
    assert d.prefill == () and d.cache_len == {"late": 20}


def test_the_queue_is_in_deadline_order_with_preempted_requests_first() -> None:
    from services.task_executor.engines.torch_engine.scheduler import enqueue, queue_due

    queue: list[tuple[str, float, bool]] = []

    def due(item: tuple[str, float, bool]) -> float:
        return queue_due(item[1], started=item[2])

    for item in [("a", 5.0, False), ("b", 3.0, False), ("c", 5.0, False), ("p", 9.0, True)]:
        enqueue(queue, item, due)
    assert [name for name, _, _ in queue] == ["p", "b", "a", "c"]  # ties in arrival order
    assert PACE.ttft_limit_s(10_000) == math.inf  # no SLO given: no deadline
    slo = dataclasses.replace(PACE, ttft_s=2.0, ttft_per_token_s=1 / 512)
    assert slo.ttft_limit_s(100) == 2.0 and slo.ttft_limit_s(2048) == 4.0


def _deadline_engine(
    model_dir: Path, monkeypatch, **kwargs: object
) -> tuple[TorchEngine, list[float]]:
    """A paced engine whose prompts are due 2 s after they arrive, or 1/16 s a token (a
    64-token prompt in 4 s), on a clock the test moves (``clock[0]``, from 100 s)."""
    from shared.messages.scaling import InstanceCapacity

    engine = _engine(model_dir, max_prefill_tokens=None, **kwargs)
    cap = InstanceCapacity(
        prefill_s=2e-3,
        prefill_attention_s=0,
        decode_s=0.01,
        decode_step_s=0.04,
        decode_context_s=0,
        max_num_seqs=4,
    )
    clock = [100.0]
    monkeypatch.setattr(
        "services.task_executor.engines.torch_engine.engine.time.monotonic", lambda: clock[0]
    )
    engine.pace_prefill(cap, 0.25, ttft_s=2.0, ttft_per_token_s=1 / 16)
    return engine, clock


def test_an_engine_with_a_ttft_target_prefills_the_prompt_due_first(
    model_dir: Path, monkeypatch
) -> None:
    engine, clock = _deadline_engine(model_dir, monkeypatch)
    engine.add_request(EngineRequest("long", list(range(3, 67)), greedy(2)))  # due at 104
    clock[0] += 0.5
    engine.add_request(EngineRequest("short", [3, 4, 5, 6], greedy(2)))  # due at 102.5 < 104
    assert [r.request_id for r in engine._waiting] == ["short", "long"]
    firsts = [o.request_id for o in engine.step() if o.new_token_ids]
    assert firsts[0] == "short"


def test_a_prompts_deadline_counts_from_its_arrival_not_from_when_the_engine_got_it(
    model_dir: Path, monkeypatch
) -> None:
    """A request held 1.5 s for a load (``EngineRequest.arrival``) is due 0.5 s after the
    engine gets it, before a short prompt that arrived just now (due in 2 s)."""
    engine, clock = _deadline_engine(model_dir, monkeypatch)
    engine.add_request(EngineRequest("fresh", [3, 4, 5, 6], greedy(2)))
    engine.add_request(EngineRequest("held", [3, 4, 5, 7], greedy(2), arrival=clock[0] - 1.5))
    assert [r.request_id for r in engine._waiting] == ["held", "fresh"]
    assert engine._requests["held"].ttft_left() == pytest.approx(0.5)


@pytest.mark.parametrize(("late_yield_s", "first"), [(3.0, "fresh"), (0.0, "late")])
def test_an_engine_serves_a_prompt_in_time_before_one_already_late(
    model_dir: Path, monkeypatch, late_yield_s: float, first: str
) -> None:
    """A 64-token prompt due at 104 s still waits at 105 s (the engine was busy); a short one
    arrives, due at 107 s. With the late prompt yielding, the short one meets its target; in
    plain deadline order the late one goes first."""
    from services.task_executor.engines.capabilities import bind_features

    engine, clock = _deadline_engine(model_dir, monkeypatch, late_yield_s=late_yield_s)
    pacing = bind_features(engine).prefill_pacing
    assert pacing is not None and pacing.late_yield_s == late_yield_s  # its TE claims turns so
    engine.add_request(EngineRequest("late", list(range(3, 67)), greedy(2)))
    clock[0] = 105.0
    engine.add_request(EngineRequest("fresh", [3, 4, 5, 6], greedy(2)))
    assert [r.request_id for r in engine._waiting] == ["late", "fresh"]  # deadline order
    firsts = [o.request_id for o in engine.step() if o.new_token_ids]
    assert firsts[0] == first
    rest = drain(engine)
    assert all(rest[rid][-1].finished for rid in ("late", "fresh"))  # both served in the end

"""A performance model whose times are round numbers, for tests of the decisions that play a
device's iterations forward (shadow validation, the arbiter's stretch, preemption): 1 ms a
prompt token, a decode step 10 ms whatever the batch and context."""

from __future__ import annotations

from shared.perf_model import PerfModel

EXACT_PERF = PerfModel(
    prefill_lengths=[16, 4096],
    prefill_s=[0.016, 4.096],
    decode_batches=[1, 32],
    decode_contexts=[16, 4096],
    decode_s=[[0.01, 0.01], [0.01, 0.01]],
    max_num_seqs=32,
)

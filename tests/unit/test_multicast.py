"""lambda-Scale's binomial pipeline: every receiver gets every block, no node sends or receives
more than one block a step, and it takes the optimal b − 1 + ⌈log2(N + 1)⌉ steps."""

import math

import pytest

from services.task_executor.weight_cache.multicast import (
    Transfer,
    binomial_pipeline,
    check_schedule,
    fan_out,
    steps_needed,
)


@pytest.mark.parametrize("receivers", range(1, 18))
def test_pipeline_delivers_every_block_in_the_stated_number_of_steps(receivers):
    for blocks in range(1, 10):
        schedule = binomial_pipeline(receivers, blocks)
        check_schedule(schedule, receivers, blocks)
        assert len(schedule) == steps_needed(receivers, blocks)
        assert steps_needed(receivers, blocks) == blocks - 1 + math.ceil(math.log2(receivers + 1))


def test_one_receiver_takes_one_step_per_block():
    assert [len(binomial_pipeline(1, b)) for b in range(1, 6)] == [1, 2, 3, 4, 5]


def test_count_is_the_classic_bound_and_the_issues_with_the_source_counted():
    for k in range(1, 6):  # 2^k nodes counting the source: b + k − 1
        assert [steps_needed(2**k - 1, b) for b in (1, 4)] == [k, 3 + k]
    for n in range(2, 18):  # the issue's b + ⌈log2 N⌉ − 1 reads N as all nodes
        assert steps_needed(n - 1, 5) == 5 + math.ceil(math.log2(n)) - 1
    # Read with N receivers it is a step short exactly when N is a power of two.
    short = [n for n in range(1, 18) if steps_needed(n, 5) != 5 + math.ceil(math.log2(n)) - 1]
    assert short == [1, 2, 4, 8, 16]


def test_receivers_forward_blocks_while_still_receiving():
    schedule = binomial_pipeline(7, 6)
    relayed = [
        t
        for step in schedule
        for t in step
        if t.sender != 0 and any(u.receiver == t.sender for u in step)
    ]
    assert relayed
    assert sum(len(step) for step in schedule) == 7 * 6  # no block is sent twice to a node


@pytest.mark.parametrize(("receivers", "blocks"), [(1, 1), (3, 4), (5, 2), (16, 3)])
def test_fan_out_sends_everything_from_the_source_one_block_a_step(receivers, blocks):
    schedule = fan_out(receivers, blocks)
    check_schedule(schedule, receivers, blocks)
    assert len(schedule) == receivers * blocks
    assert all(len(step) == 1 and step[0].sender == 0 for step in schedule)
    assert len(binomial_pipeline(receivers, blocks)) <= len(schedule)


def _schedule(*steps):
    return [[Transfer(i, *t) for t in step] for i, step in enumerate(steps)]


@pytest.mark.parametrize(
    ("schedule", "error"),
    [
        (_schedule([(0, 1, 0), (0, 2, 1)], [(1, 2, 0), (2, 1, 1)]), "node 0 sends more than one"),
        (
            _schedule([(0, 1, 0)], [(0, 2, 0), (1, 2, 0)], [(0, 1, 1)]),
            "node 2 receives more than one",
        ),
        (_schedule([(0, 1, 0)], [(1, 2, 1), (0, 1, 1)]), "node 1 does not hold block 1"),
        # A block received in a step can be forwarded in the next step, not in the same one.
        (_schedule([(0, 1, 0), (1, 2, 0)]), "node 1 does not hold block 0"),
        (_schedule([(0, 1, 0)], [(0, 2, 0), (1, 3, 0)]), "no such sender or receiver"),
        (_schedule([(0, 1, 0)], [(1, 1, 0)]), "sends to itself"),
        (_schedule([(0, 1, 0)], [(0, 2, 0)], [(0, 1, 1)]), r"receiver 2 never gets blocks \[1\]"),
    ],
)
def test_check_schedule_rejects_what_breaks_the_model(schedule, error):
    with pytest.raises(ValueError, match=error):
        check_schedule(schedule, receivers=2, blocks=2)


def test_check_schedule_rejects_a_transfer_filed_under_another_step():
    with pytest.raises(ValueError, match="listed in step 0"):
        check_schedule([[Transfer(1, 0, 1, 0)]], receivers=1, blocks=1)


@pytest.mark.parametrize("build", [binomial_pipeline, fan_out, steps_needed])
@pytest.mark.parametrize(("receivers", "blocks"), [(0, 3), (3, 0), (-1, 1)])
def test_invalid_arguments_are_rejected(build, receivers, blocks):
    with pytest.raises(ValueError):
        build(receivers, blocks)
    with pytest.raises(ValueError):
        check_schedule([], receivers, blocks)

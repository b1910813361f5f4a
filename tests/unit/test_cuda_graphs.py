"""The shape buckets of the torch engine's CUDA graphs (pure; the graphs themselves are tested
on a GPU in test_torch_engine_cuda.py)."""

import pytest

from services.task_executor.engines.torch_engine.cuda_graphs import (
    batch_buckets,
    bucket,
    width_buckets,
)


def test_batch_buckets_end_at_the_engines_largest_batch() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 12, 16, 20]


def test_width_buckets_are_powers_of_two_up_to_the_longest_table() -> None:
    assert width_buckets(1) == [1]
    assert width_buckets(8) == [1, 2, 4, 8]
    assert width_buckets(129) == [1, 2, 4, 8, 16, 32, 64, 128, 129]


def test_a_size_goes_to_the_smallest_bucket_that_holds_it() -> None:
    sizes = width_buckets(129)
    assert [bucket(n, sizes) for n in (1, 2, 3, 64, 65, 128, 129)] == [1, 2, 4, 64, 128, 128, 129]
    with pytest.raises(ValueError, match="exceeds"):
        bucket(130, sizes)

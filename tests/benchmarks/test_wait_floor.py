"""The data-wait floor of a staleness bound (``benchmarks/wait_floor.py``): worked by hand."""

import pytest

from relax.benchmarks.wait_floor import data_wait_floor, floor_pct


def test_training_longer_than_generation_never_waits():
    assert data_wait_floor([10.0, 6.0, 6.0, 6.0], gen_s=5.0, max_staleness=1) == [0.0] * 4


def test_a_short_step_makes_the_next_one_wait_at_staleness_1():
    # steps end at 10, 16, 19; batch 4 needs the weights of step 2 (ended at 16) and
    # takes 5 s: ready at 21, so step 4 waits 21 - 19 = 2 s and ends at 27; batch 5
    # needs step 3's (ended at 19) and the rollout, free at 21: ready at 26, no wait
    own = [10.0, 6.0, 3.0, 6.0, 6.0]
    assert data_wait_floor(own, gen_s=5.0, max_staleness=1) == [0.0, 0.0, 0.0, 2.0, 0.0]
    assert floor_pct(own, 5.0, 1) == pytest.approx(100 * 2 / (2 + 21))


def test_a_larger_staleness_hides_the_short_step():
    # at s=2 batch 4 needs step 1's weights (ended at 10): ready at 15, long before 19
    assert data_wait_floor([10.0, 6.0, 3.0, 6.0, 6.0], gen_s=5.0, max_staleness=2) == [0.0] * 5


def test_the_rollout_makes_one_batch_at_a_time():
    # training takes no time: every batch past the first two waits for the one rollout
    # (batch 3 needs step 1's weights, at 0, and is ready at 5; batch 4 at 10, ...)
    assert data_wait_floor([0.0] * 5, gen_s=5.0, max_staleness=1) == [0.0, 0.0, 5.0, 5.0, 5.0]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="max_staleness >= 0"):
        data_wait_floor([1.0], gen_s=1.0, max_staleness=-1)
    with pytest.raises(ValueError, match="own_s >= 0"):
        data_wait_floor([1.0, -2.0], gen_s=1.0, max_staleness=1)

"""The decision of ``benchmarks/elastic_threads.py``: when a trainer takes the second core."""

import pytest

from relax.benchmarks.elastic_threads import want_threads


def test_at_two_threads_another_runnable_thread_or_a_run_delay_drops_to_one():
    assert want_threads(2, 1, 2, running=2, delay_s=0.0, interval_s=0.005, quiet=0) == (2, 0)
    assert want_threads(2, 1, 2, running=3, delay_s=0.0, interval_s=0.005, quiet=0) == (1, 0)
    # the second OpenMP thread asleep between regions: the count alone says 2; the delay sees it
    assert want_threads(2, 1, 2, running=2, delay_s=0.001, interval_s=0.005, quiet=0) == (1, 0)
    assert want_threads(2, 1, 2, running=1, delay_s=0.0004, interval_s=0.005, quiet=0) == (2, 0)


def test_at_one_thread_two_quiet_checks_in_a_row_take_the_second_core():
    assert want_threads(1, 1, 2, running=1, delay_s=0.0, interval_s=0.005, quiet=0) == (1, 1)
    assert want_threads(1, 1, 2, running=1, delay_s=0.0, interval_s=0.005, quiet=1) == (2, 0)
    assert want_threads(1, 1, 2, running=2, delay_s=0.0, interval_s=0.005, quiet=1) == (1, 0)


def test_equal_settings_never_switch_and_bad_settings_are_refused():
    assert want_threads(1, 1, 1, running=5, delay_s=1.0, interval_s=0.005, quiet=0) == (1, 0)
    with pytest.raises(ValueError, match="1 <= low <= high"):
        want_threads(3, 1, 2, running=1, delay_s=0.0, interval_s=0.005, quiet=0)
    with pytest.raises(ValueError, match="1 <= low <= high"):
        want_threads(1, 2, 1, running=1, delay_s=0.0, interval_s=0.005, quiet=0)

"""policy_version / staleness admission (schemas/versions.py): public cases C25, C27."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax.schemas.versions import (admit, admit_batch, in_flight_budget, off_policy_steps,
                                    oldest_version, staleness)


# C25: R spans v3->v4, Q runs under v4, P spans v3->v4->v5; each is consumed as soon as
# it ends (trainer version = its end version), so staleness = off-policy steps.
ROLLOUTS = {"R": (3, 4), "Q": (4, 4), "P": (3, 5)}


def test_c25_one_increment_per_update():
    assert off_policy_steps(*ROLLOUTS["R"]) == 1
    assert off_policy_steps(*ROLLOUTS["Q"]) == 0
    assert off_policy_steps(*ROLLOUTS["P"]) == 2
    assert off_policy_steps(*ROLLOUTS["R"]) != 2  # typical wrong: double increment


@pytest.mark.parametrize("max_staleness, admitted", [(0, {"Q"}), (1, {"Q", "R"}), (2, {"Q", "R", "P"})])
def test_c25_bound_is_inclusive_and_exact(max_staleness, admitted):
    got = {name for name, (start, end) in ROLLOUTS.items()
           if admit(end, start, end, max_staleness).admitted}
    assert got == admitted


def test_c25_max_zero_rejects_any_rollout_spanning_an_update():
    assert not admit(4, 3, 4, 0).admitted  # typical wrong: R admitted at max = 0
    assert admit(4, 4, 4, 0).admitted


def test_c27_queue_time_counts():
    a = admit(8, 5, 5, 2)
    assert a.staleness == 3 and not a.admitted
    assert "3 > max_staleness 2" in a.reason
    assert staleness(8, 5) == 3 != off_policy_steps(5, 5)  # typical wrong: 0 (generation only)


def test_partial_rollout_oldest_token_version_counts():
    assert oldest_version(6, [4, 6, 7]) == 4
    assert staleness(8, 6, [4, 6, 7]) == 4
    assert not admit(8, 6, 7, 3, [4, 6, 7]).admitted


def test_a_generation_split_by_a_swap_counts_from_its_first_chunk():
    """The rows partial rollout makes (tests/e2e/test_partial_rollout.py): chunks of v5 then
    v6, consumed by the trainer at v6: staleness 1, though its last token is current, so
    sync mode never admits it and max_staleness 1 does."""
    split = [5, 5, 5, 6, 6]
    assert staleness(6, 5, split) == 1 and staleness(7, 5, split) == 2
    assert not admit(6, 5, 6, 0, split).admitted and admit(6, 5, 6, 1, split).admitted


@settings(max_examples=200, deadline=None)
@given(start=st.integers(0, 50), span=st.integers(0, 5), wait=st.integers(0, 5),
       max_staleness=st.integers(0, 6))
def test_admission_family(start, span, wait, max_staleness):
    end = start + span
    trainer = end + wait
    a = admit(trainer, start, end, max_staleness)
    assert off_policy_steps(start, end) == span
    assert a.staleness == span + wait == trainer - start
    assert a.admitted == (span + wait <= max_staleness)
    assert (a.reason is None) == a.admitted
    if max_staleness == 0:
        assert a.admitted == (span == 0 and wait == 0)


@pytest.mark.parametrize("args", [
    (5, -1, 3, 1),   # negative start
    (5, 4, 3, 1),    # end < start
    (5, 3, 6, 1),    # end newer than trainer
    (5, 3, 4, -1),   # negative max_staleness
    (-1, 0, 0, 0),   # negative trainer version
])
def test_admit_rejects_impossible_versions(args):
    with pytest.raises(ValueError):
        admit(*args)


def test_admit_batch_matches_admit_row_by_row():
    starts, ends, tokens = [5, 3, 4, 3], [5, 4, 4, 5], [None, None, None, [3, 4, 5]]
    got = admit_batch(6, starts, ends, 2, tokens)
    assert got == [admit(6, s, e, 2, t) for s, e, t in zip(starts, ends, tokens)]
    assert [a.staleness for a in got] == [1, 3, 2, 3]
    assert [a.admitted for a in got] == [True, False, True, False]
    with pytest.raises(ValueError, match="differ in length"):
        admit_batch(6, [1, 2], [1], 2)


def test_in_flight_budget():
    assert in_flight_budget(0, 8) == 8
    assert in_flight_budget(2, 8) == 24
    with pytest.raises(ValueError):
        in_flight_budget(-1, 8)

"""Stall rules of the controller (pure logic)."""

from __future__ import annotations

from relax.infra.watch import (
    StageWatch,
    broker_state_lost,
    input_group,
    input_stalled,
    loop_stalled,
)


def test_input_stalled_only_when_input_waits_and_nothing_is_committed_for_the_limit():
    w = StageWatch(since=0.0)
    a = {("r.rollouts", 0): 5}
    assert not input_stalled(w, a, lag=3, now=1.0, timeout_s=10)   # first look: clock starts
    assert not input_stalled(w, a, lag=3, now=10.5, timeout_s=10)
    assert input_stalled(w, a, lag=3, now=11.5, timeout_s=10)      # 10.5 s, no commit
    b = {("r.rollouts", 0): 6}
    assert not input_stalled(w, b, lag=2, now=12.0, timeout_s=10)  # committed: clock restarts
    assert not input_stalled(w, b, lag=0, now=30.0, timeout_s=10)  # nothing waits: idle is fine
    assert not input_stalled(w, b, lag=1, now=35.0, timeout_s=10)  # counted from the idle look
    assert input_stalled(w, b, lag=1, now=40.5, timeout_s=10)


def test_loop_stalled_names_the_cause():
    assert loop_stalled(True, 2.0, 0.0, 10) is None
    assert "inside one call for 12s" in loop_stalled(True, 12.0, 0.0, 10)
    assert loop_stalled(True, None, 0.0, 10) is None          # still starting: not judged
    assert loop_stalled(False, None, 5.0, 10) is None         # one missed answer is no stall
    assert "not answered a heartbeat for 11s" in loop_stalled(False, None, 11.0, 10)


def test_input_group_of_each_stage_kind():
    assert input_group("r", "reward", "reward.correct") == ("r.reward.correct", ["r.rollouts"])
    assert input_group("r", "aggregate", "aggregate") == ("r.aggregate", ["r.rollouts", "r.rewards"])
    assert input_group("r", "reference", "teacher") == ("r.teacher", ["r.rollouts"])
    assert input_group("r", "reference", "reference") == ("r.reference", ["r.rollouts"])
    assert input_group("r", "trainer", "trainer") is None
    assert input_group("r", "rollout", "rollout-0") is None


def test_broker_state_lost_when_the_metrics_log_shrinks_or_vanishes():
    assert not broker_state_lost(None, 0)           # nothing seen yet
    assert not broker_state_lost(40, 40) and not broker_state_lost(40, 57)
    assert broker_state_lost(40, 3)                  # restarted, re-created by a stage
    assert broker_state_lost(40, None)               # restarted, not re-created yet

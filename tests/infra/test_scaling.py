"""The scaling operations' state machine (pure: the controller's part is a function that
records what it was asked)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from relax.infra.scaling import RolloutScaler, ScaleConflict, ScaleError


def _scaler(applied: list[int]) -> RolloutScaler:
    def apply(n: int) -> list[str]:
        applied.append(n)
        return [f"rollout-{i}" for i in range(n)]
    return RolloutScaler(instances=1, max_instances=3, apply=apply, timeout_s=60)


def _beats(n: int, loop: float | None = 0.1) -> dict:
    return {f"rollout-{i}": {"loop_age_s": loop} for i in range(n)}


def _rows(n: int, version: int) -> list[dict]:
    ts = datetime.now(timezone.utc) + timedelta(milliseconds=1)  # as decoded from the bus
    return [{"component": f"rollout-{i}", "policy_version": version, "ts": ts} for i in range(n)]


def test_an_operation_goes_through_its_states_once():
    applied = []
    sc = _scaler(applied)
    op = sc.request(2)
    assert op.state == "PENDING" and sc.request(2) is op  # a retry is the same operation
    assert sc.base() == 1  # a retried "+1" names the same target
    sc.advance({}, [], trainer_version=5)
    assert op.state == "HEALTH_CHECKING" and applied == [2] and sc.instances == 2
    sc.advance(_beats(2, loop=None), [], 5)
    assert op.state == "HEALTH_CHECKING"  # loops not turning yet
    sc.advance(_beats(2), [], 5)
    assert op.state == "WEIGHT_SYNCING"
    sc.advance(_beats(2), _rows(2, 4), 6)  # weights older than the trainer's at the start
    assert op.state == "WEIGHT_SYNCING"
    sc.advance(_beats(2), _rows(1, 5), 6)  # one instance only
    assert op.state == "WEIGHT_SYNCING"
    sc.advance(_beats(2), _rows(2, 5), 6)
    assert op.state == "ACTIVE" and applied == [2]
    assert [h.split(" ", 1)[1].split(":")[0] for h in op.history] == \
        ["PENDING", "STARTING", "HEALTH_CHECKING", "WEIGHT_SYNCING", "ACTIVE"]
    assert sc.request(2) is op and sc.base() == 2  # already there


def test_one_operation_at_a_time_and_cancel_only_before_it_starts():
    sc = _scaler([])
    op = sc.request(2)
    with pytest.raises(ScaleConflict, match=op.id):
        sc.request(3)
    assert sc.cancel(op.id).state == "CANCELLED"
    op3 = sc.request(3)
    sc.advance({}, [], 0)
    with pytest.raises(ScaleConflict, match="only a PENDING one"):
        sc.cancel(op3.id)
    with pytest.raises(KeyError):
        sc.cancel("nope")


@pytest.mark.parametrize("n", [0, 4])
def test_counts_outside_the_partitions_are_refused(n):
    with pytest.raises(ScaleError, match=r"instances: .* outside 1\.\.3"):
        _scaler([]).request(n)


def test_an_operation_that_does_not_finish_fails():
    sc = _scaler([])
    sc.timeout_s = 0.0
    op = sc.request(2)
    sc.advance({}, [], 0)
    sc.advance({}, [], 0)
    assert op.state == "FAILED" and "not ACTIVE after" in op.error


def test_engines_report_the_running_operation():
    sc = _scaler([])
    sc.request(2)
    sc.advance({}, [], 0)
    engines = sc.engines(_beats(2), {"rollout-0": {"pid": 7, "node": "10.0.0.2", "restarts": 1}})
    assert [(e["name"], e["state"], e["pid"]) for e in engines] == \
        [("rollout-0", "HEALTH_CHECKING", 7), ("rollout-1", "HEALTH_CHECKING", None)]

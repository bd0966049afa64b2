"""Live reward changes (issue 16): the plan per group policy_version (pure), the join
deciding groups by it, and announce/follow on a real broker."""

from __future__ import annotations

import pyarrow as pa
import pytest
from testdata import reward_rows, rollout_rows

from relax.consumers.aggregate import JoinState
from relax.consumers.aggregate_config import AdvantageConfig
from relax.consumers.reward.changes import ChangeFollower, announce, latest_policy_version
from relax.consumers.reward.plan import RewardChange, RewardPlan, group_policy_version
from relax.schemas import topics
from relax.schemas.v1 import REWARDS, ROLLOUTS
from relax.streams.producer import BatchProducer
from relax.streams.progress import PROGRESS_KEY, progress_row


def test_plan_at_each_version():
    plan = RewardPlan({"math": 1.0})
    assert plan.apply(RewardChange("attach", "fmt", 0.5, 3)) is None
    assert plan.apply(RewardChange("attach", "math", 2.0, 5)) is None  # a new weight
    assert plan.apply(RewardChange("detach", "fmt", 0.0, 7)) is None
    assert plan.at(0) == plan.at(2) == {"math": 1.0}
    assert plan.at(3) == plan.at(4) == {"math": 1.0, "fmt": 0.5}
    assert plan.at(5) == {"math": 2.0, "fmt": 0.5}
    assert plan.at(7) == plan.at(100) == {"math": 2.0}
    assert plan.names() == {"math", "fmt"}


def test_plan_refuses_a_detach_that_cannot_apply():
    plan = RewardPlan({"math": 1.0})
    assert "not counted" in plan.apply(RewardChange("detach", "fmt", 0.0, 2))
    assert "no counted reward would be left" in plan.apply(RewardChange("detach", "math", 0.0, 2))
    assert plan.changes == []
    # a detach at 4 is fine while an attach counts from 2 ... and an earlier detach of
    # the attached name's partner would empty the plan after it
    assert plan.apply(RewardChange("attach", "fmt", 1.0, 2)) is None
    assert plan.apply(RewardChange("detach", "math", 0.0, 4)) is None
    assert "no counted reward" in plan.apply(RewardChange("detach", "fmt", 0.0, 3))
    assert plan.at(4) == {"fmt": 1.0}


def test_change_checks_its_fields():
    with pytest.raises(ValueError, match="action 'add'"):
        RewardChange("add", "fmt", 1.0, 1)
    with pytest.raises(ValueError, match="from_policy_version -1"):
        RewardChange("attach", "fmt", 1.0, -1)
    assert group_policy_version([4, 3, 5]) == 3
    with pytest.raises(ValueError, match="without rollouts"):
        group_policy_version([])


def _table(rows, schema):
    return pa.Table.from_pylist(rows, schema=schema)


def _group(gid_index: int, version: int, group_size: int = 2) -> list[dict]:
    rows = rollout_rows(group_size * (gid_index + 1), group_size=group_size,
                        policy_version=version)[group_size * gid_index:]
    return rows


def test_join_counts_the_plan_at_the_group_policy_version():
    plan = RewardPlan({"math": 1.0})
    s = JoinState(AdvantageConfig(rewards={"math": 1.0}), plan)
    old, new = _group(0, version=2), _group(1, version=3)
    # scores of the reward to be attached arrive before its change: they are kept
    for rows in (old, new):
        s.add("rollouts", _table(rows, ROLLOUTS), 0.0)
        s.add("rewards", _table(reward_rows(rows, "len", [1.0, 0.0]), REWARDS), 0.0)
    assert plan.apply(RewardChange("attach", "len", 0.5, 3)) is None
    s.add("rewards", _table(reward_rows(old + new, "math", [1, 0, 1, 1]), REWARDS), 0.0)
    done = dict(s.take_ready(1.0, timeout_s=100))
    assert set(done) == {"g0000", "g0001"}
    assert done["g0000"].column("reward").to_pylist() == [1.0, 0.0]  # untouched
    assert [dict(c) for c in done["g0000"].column("reward_components").to_pylist()] == \
        [{"math": 1.0}, {"math": 0.0}]
    assert done["g0001"].column("reward").to_pylist() == [1.5, 1.0]  # 1 + 0.5 x len


def test_join_waits_for_an_attached_reward_and_not_for_a_detached_one():
    plan = RewardPlan({"math": 1.0, "fmt": 1.0})
    s = JoinState(AdvantageConfig(rewards={"math": 1.0, "fmt": 1.0}), plan)
    plan.apply(RewardChange("attach", "len", 1.0, 5))
    plan.apply(RewardChange("detach", "fmt", 0.0, 5))
    rows = _group(0, version=5)
    s.add("rollouts", _table(rows, ROLLOUTS), 0.0)
    s.add("rewards", _table(reward_rows(rows, "math", [1, 0]), REWARDS), 0.0)
    assert s.take_ready(1.0, timeout_s=100) == []  # waits for len, not for fmt
    s.add("rewards", _table(reward_rows(rows, "len", [0.25, 0.25]), REWARDS), 0.0)
    (gid, out), = s.take_ready(1.0, timeout_s=100)
    assert out.column("reward").to_pylist() == [1.25, 0.25]
    # a group whose rollouts straddle the change (min start 4) keeps the old rewards
    mixed = _group(1, version=5)
    mixed[0]["policy_version_start"] = 4
    s.add("rollouts", _table(mixed, ROLLOUTS), 0.0)
    for name in ("math", "fmt"):
        s.add("rewards", _table(reward_rows(mixed, name, [1, 1]), REWARDS), 0.0)
    (gid, out), = s.take_ready(1.0, timeout_s=100)
    assert gid == "g0001" and out.column("reward").to_pylist() == [2.0, 2.0]


def test_announce_and_follow_on_the_broker(bus, unique):
    run = unique
    assert latest_policy_version(bus, run) == 0
    follower = ChangeFollower(bus, run)
    try:
        assert follower.poll() == []
        a = announce(bus, run, "attach", "len", 0.5)
        assert a == RewardChange("attach", "len", 0.5, 2)
        p = BatchProducer(bus)
        p.send(topics.run_topic(run, topics.PROGRESS), progress_row(8, 8, 4), key=PROGRESS_KEY)
        p.flush()
        p.close()
        assert latest_policy_version(bus, run) == 4
        with pytest.raises(ValueError, match="is at policy_version 4"):
            announce(bus, run, "detach", "len", from_policy_version=5)
        d = announce(bus, run, "detach", "len", weight=9.0)
        assert d == RewardChange("detach", "len", 0.0, 6)
        got = []
        for _ in range(100):
            got += follower.poll(timeout_s=0.2)
            if len(got) == 2:
                break
        assert got == [a, d]
        # a new follower (a restarted aggregator) reads all of them on its first poll
        again = ChangeFollower(bus, run)
        assert again.poll() == [a, d]
        again.close()
    finally:
        follower.close()


def test_follower_read_to_the_end_returns_every_acknowledged_change(bus, unique):
    """What the aggregator does before it decides a group of a newer policy_version: a
    change acknowledged a moment ago is returned by ``poll(to_end=True)`` even when the
    client has not fetched it yet (a plain ``poll()`` may miss it: a CI run counted a
    detached reward for one group so)."""
    run = unique
    follower = ChangeFollower(bus, run)
    try:
        assert follower.poll() == []
        for i in range(5):
            a = announce(bus, run, "attach" if i % 2 == 0 else "detach", "len", 0.5)
            assert follower.poll(to_end=True) == [a]
        assert follower.poll(timeout_s=0.5) == []  # nothing returned twice
    finally:
        follower.close()

"""The aggregator: join, emit, duplicates, restart recovery."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest
from testdata import reward_rows, rollout_rows

from relax.consumers.aggregate import AggregateStage, JoinState
from relax.consumers.aggregate_config import AdvantageConfig, AggregateConfig
from relax.schemas import topics
from relax.schemas.v1 import REWARDS, ROLLOUTS
from relax.streams.client import ensure_topics
from relax.streams.producer import BatchProducer
from relax.streams.read import read_table
from relax.streams.stage_contract import wired


def test_join_state_completes_only_with_all_counted_rewards():
    cfg = AdvantageConfig(rewards={"math": 1.0, "fmt": 0.1})
    s = JoinState(cfg)
    rows = rollout_rows(2, group_size=2)
    s.add("rollouts", pa.Table.from_pylist(rows, schema=ROLLOUTS), 0.0)
    s.add("rewards", pa.Table.from_pylist(reward_rows(rows, "math", [1, 0]), schema=REWARDS), 0.0)
    s.add("rewards", pa.Table.from_pylist(reward_rows(rows, "other", [1, 1]), schema=REWARDS), 0.0)
    assert s.take_ready(1.0, timeout_s=100) == []
    s.add("rewards", pa.Table.from_pylist(reward_rows(rows, "fmt", [1, 0]), schema=REWARDS), 0.0)
    (gid, out), = s.take_ready(1.0, timeout_s=100)
    assert gid == "g0000" and out.num_rows == 2
    # redelivery of an emitted group is ignored
    assert s.add("rollouts", pa.Table.from_pylist(rows, schema=ROLLOUTS), 2.0) is None
    assert s.take_ready(3.0, timeout_s=100) == [] and s.duplicates == 2


def test_join_state_waits_for_teacher_logprobs_when_distilling():
    """distill_coef > 0: a group is complete only with every rollout's teacher log-probs,
    which reach its train samples; without distillation teacher rows are ignored."""
    from relax.schemas.v1 import TEACHER_LOGPROBS

    rows = rollout_rows(2, group_size=2, tokens=3)
    teacher = pa.Table.from_pylist(
        [dict(rollout_id=r["rollout_id"], group_id=r["group_id"], teacher_logprobs=[-1.0] * 3,
              teacher_model="t") for r in rows], schema=TEACHER_LOGPROBS)
    s = JoinState(AdvantageConfig(rewards={"math": 1.0}, distill_coef=0.5))
    s.add("rollouts", pa.Table.from_pylist(rows, schema=ROLLOUTS), 0.0)
    s.add("rewards", pa.Table.from_pylist(reward_rows(rows, "math", [1, 0]), schema=REWARDS), 0.0)
    s.add("teacher_logprobs", teacher.slice(0, 1), 0.0)
    assert s.take_ready(1.0, timeout_s=100) == []
    assert s.add("teacher_logprobs", teacher.slice(0, 1), 0.0) is None  # a duplicate
    s.add("teacher_logprobs", teacher.slice(1, 1), 0.0)
    (_, out), = s.take_ready(1.0, timeout_s=100)
    assert out.column("teacher_logprobs").to_pylist() == [[-1.0] * 3] * 2
    # advantage: outcome +-0.7070 minus 0.5 x (logprobs -0.25 - teacher -1.0) = -0.375
    first = [a[0] for a in out.column("advantages").to_pylist()]
    assert first[0] - first[1] == pytest.approx(1.414, abs=1e-3)
    assert first[0] + first[1] == pytest.approx(-0.75, abs=1e-5)
    plain = JoinState(AdvantageConfig(rewards={"math": 1.0}))
    assert plain.add("teacher_logprobs", teacher, 0.0) is None


def test_join_state_timeout_emits_uneven_group():
    s = JoinState(AdvantageConfig())
    rows = rollout_rows(4, group_size=4)
    s.add("rollouts", pa.Table.from_pylist(rows[:3], schema=ROLLOUTS), 0.0)
    s.add("rewards", pa.Table.from_pylist(reward_rows(rows[:2], "math", [1, 0]), schema=REWARDS), 0.0)
    assert s.take_ready(5.0, timeout_s=10) == []
    (gid, out), = s.take_ready(11.0, timeout_s=10)
    assert out.column("drop_reason").to_pylist() == [None, None, "filtered_group_timeout"]


def _send(p, topic, rows, schema):
    p.send(topic, pa.RecordBatch.from_pylist(rows, schema=schema))
    p.flush()


def _wait_rows(bus, topic, n, stage=None, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stage is not None:
            stage.turn()
        t = read_table(bus, topic)
        if t.num_rows >= n:
            return t
    raise AssertionError(f"{topic}: fewer than {n} rows after {timeout_s}s")


def test_stage_joins_and_survives_restart(bus, unique):
    run = unique
    cfg = AggregateConfig(run=run, partitions=2, group_timeout_s=300,
                          advantage=AdvantageConfig(rewards={"math": 1.0}))
    rt, wt, st = (topics.run_topic(run, n) for n in ("rollouts", "rewards", "train_samples"))
    ensure_topics(bus, {rt: 2, wt: 2})
    p = BatchProducer(bus)
    rows = rollout_rows(12, group_size=4)  # groups g0000..g0002
    _send(p, rt, rows, ROLLOUTS)
    _send(p, wt, reward_rows(rows[:4], "math", [1, 0, 0, 0]), REWARDS)
    _send(p, wt, reward_rows(rows[4:6], "math", [1, 1]), REWARDS)  # g0001 half done
    stage = AggregateStage(cfg, bus)
    with wired(stage):  # the stage contract's wiring, closed on exit
        out = _wait_rows(bus, st, 4, stage)
        assert set(out.column("group_id").to_pylist()) == {"g0000"}
        for _ in range(3):
            stage.turn()
    # g0001 and g0002 are partial: their rows live in the changelog only
    m = [r for r in read_table(bus, topics.run_topic(run, "metrics")).to_pylist()
         if r["component"] == "aggregate-0"]
    last = {r["name"]: r["value"] for r in m}
    assert last["partial_groups"] == 2 and last["groups_emitted"] == 1
    assert 0 <= last["oldest_partial_s"] < 300

    _send(p, wt, reward_rows(rows[6:8], "math", [0, 0]), REWARDS)
    _send(p, wt, reward_rows(rows[8:12], "math", [1, 1, 0, 1]), REWARDS)
    _send(p, rt, rows[4:5], ROLLOUTS)  # a redelivered rollout
    stage2 = AggregateStage(cfg, bus, instance="aggregate-1")
    with wired(stage2):
        out = _wait_rows(bus, st, 12, stage2)
    ids = out.column("rollout_id").to_pylist()
    assert sorted(ids) == sorted(r["rollout_id"] for r in rows) and len(ids) == 12
    by = {r["rollout_id"]: r for r in out.to_pylist()}
    assert by["g0001/0"]["advantages"][0] > 0 > by["g0001/3"]["advantages"][0]
    assert all(r["drop_reason"] is None for r in by.values())

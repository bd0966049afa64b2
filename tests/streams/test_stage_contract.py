"""The stage contract (streams/stage_contract.py) on the real broker: the declared topics
are made (and a missing input or a mismatched co-partitioned output is a clear error),
run_stage routes a RecordError to the error topic, commits what it flushed, writes the
busy fraction, and closes the stage's own parts, its consumer and its producer whether
the stage ends or raises."""

from __future__ import annotations

import pyarrow as pa
import pytest
from testdata import alternating_rewards, rollout_rows

from relax.schemas import topics
from relax.schemas.v1 import REWARDS, ROLLOUTS
from relax.streams.client import admin, ensure_topics, topic_partitions
from relax.streams.lag import group_offsets, high_watermarks
from relax.streams.producer import BatchProducer
from relax.streams.read import read_table
from relax.streams.stage import RecordError, StageStats, process_once
from relax.streams.stage_contract import (
    Declaration,
    Hooks,
    Input,
    OutTopic,
    Stage,
    ensure_declared_topics,
    run_stage,
    wired,
)


class Scorer(Stage):
    """A small stage: each rollout message -> its rewards; a message of group ``bad``
    raises RecordError, one of group ``fail`` RuntimeError (the stage stops)."""

    kind = "scorer"
    config_type = dict

    def __init__(self, run: str, bus, bad: str | None = None, fail: str | None = None):
        self.run_name, self.bus, self.bad, self.fail = run, bus, bad, fail
        self.src = topics.run_topic(run, topics.ROLLOUTS)
        self.out = topics.run_topic(run, topics.REWARDS)
        self.stats = StageStats()
        self.closed = self.finished = False
        self.w = None

    def declare(self) -> Declaration:
        return Declaration(run=self.run_name, component="scorer-0",
                           producer_id=f"{self.run_name}-scorer",
                           input=Input((self.src,), topics.group(self.run_name, "scorer"),
                                       stage="scorer", must_exist=True),
                           outputs=(OutTopic(self.out),))

    def build(self, w) -> None:
        self.w = w

    def _fn(self, d):
        if d.key == (self.bad or "").encode():
            raise RecordError("response_text: expected a string", row=0)
        if d.key == (self.fail or "").encode():
            raise RuntimeError("scorer failed")
        rows = alternating_rewards(d.table.to_pylist())
        return [(self.out, pa.RecordBatch.from_pylist(rows, schema=REWARDS))]

    def turn(self) -> int:
        return process_once(self.w.consumer, self.w.producer, self._fn, stage="scorer",
                            poll_timeout_s=0.3, stats=self.stats)

    def hooks(self) -> Hooks:
        return Hooks(exit_when_idle_s=1.5)

    def finish(self) -> None:
        self.finished = True

    def close(self) -> None:
        self.closed = True


def _publish(bus, run: str, groups: int, partitions: int = 2) -> list[dict]:
    src = topics.run_topic(run, topics.ROLLOUTS)
    ensure_topics(bus, {src: partitions})
    rows = rollout_rows(groups * 2, group_size=2, tokens=3)
    p = BatchProducer(bus)
    for g in range(groups):  # one message per group
        p.send(src, pa.RecordBatch.from_pylist(rows[2 * g: 2 * g + 2], schema=ROLLOUTS))
    p.close()
    return rows


def test_declared_topics_are_made_and_bad_ones_named(bus, unique):
    stage = Scorer(unique, bus)
    d = stage.declare()
    with pytest.raises(ValueError, match=f"has no topic '{unique}.rollouts'"):
        ensure_declared_topics(bus, d)
    ensure_topics(bus, {d.input.topics[0]: 3})
    ensure_declared_topics(bus, d)
    assert topic_partitions(bus, [stage.out, topics.errors_topic(stage.src)]) == {
        stage.out: 3, topics.errors_topic(stage.src): 1}  # co-partitioned; errors: 1
    other = Scorer(unique + "x", bus)
    ensure_topics(bus, {other.src: 2, other.out: 4})
    with pytest.raises(ValueError, match="exists with 4 partitions, expected 2"):
        ensure_declared_topics(bus, other.declare())
    with pytest.raises(ValueError, match="made without a bus"), wired(Scorer(unique, None)):
        pass


def test_run_stage_routes_errors_commits_and_closes(bus, unique):
    rows = _publish(bus, unique, groups=4)
    stage = Scorer(unique, bus, bad="g0001")
    stats = run_stage(stage)  # ends after 1.5 s idle (its hook)
    assert stats is stage.stats and stats.messages == 4 and stats.errors == 1
    got = read_table(bus, stage.out).to_pylist()
    assert sorted(r["rollout_id"] for r in got) == sorted(
        r["rollout_id"] for r in rows if r["group_id"] != "g0001")
    errors = read_table(bus, topics.errors_topic(stage.src)).to_pylist()
    assert [e["stage"] for e in errors] == ["scorer"] and "expected a string" in errors[0]["error"]
    # every input offset committed (after its outputs were flushed)
    written = {k: v for k, v in high_watermarks(bus, [stage.src]).items() if v}
    assert group_offsets(bus, f"{unique}.scorer") == written
    metrics = [r for r in read_table(bus, topics.run_topic(unique, topics.METRICS)).to_pylist()
               if r["component"] == "scorer-0"]
    assert any(r["name"] == "busy_frac" and 0 <= r["value"] <= 1 for r in metrics)
    assert stage.finished and stage.closed
    assert _members(bus, f"{unique}.scorer") == 0  # the contract closed the consumer


def _members(bus, group_id: str) -> int:
    a = admin(bus)
    try:
        return len(a.describe_groups([group_id])[group_id]["members"])
    finally:
        a.close()


def test_a_stage_that_raises_is_closed_and_its_poll_not_committed(bus, unique):
    """One partition, messages g0000, g0001 (the function raises), g0002: the stage stops
    with the error, closed, without its normal end (no finish), and nothing of the failed
    poll committed: a restarted stage reads it again (at-least-once)."""
    _publish(bus, unique, groups=3, partitions=1)
    stage = Scorer(unique, bus, fail="g0001")
    with pytest.raises(RuntimeError, match="scorer failed"):
        run_stage(stage)
    assert stage.closed and not stage.finished
    assert _members(bus, f"{unique}.scorer") == 0
    committed = group_offsets(bus, f"{unique}.scorer").get((stage.src, 0), 0)
    assert committed <= 1  # g0001 (offset 1) and what follows it: not committed
    assert run_stage(Scorer(unique, bus)).messages == 3 - committed


def test_the_table_names_each_stage_by_its_kind():
    """The one table of contract stages (infra/recipe/specs.py) holds Stage classes under
    their own kind, each with a config class of its own (the one the table names beside
    it, loaded without the stage); an unknown kind lists them."""
    from relax.infra.recipe.specs import CONTRACT_STAGES, stage_class, stage_config_type

    assert list(CONTRACT_STAGES) == ["rollout", "reward", "reference", "aggregate", "trainer",
                                     "eval"]
    for kind in CONTRACT_STAGES:
        cls = stage_class(kind)
        assert issubclass(cls, Stage) and cls.kind == kind
        assert cls.config_type is stage_config_type(kind)
        assert "bus" not in cls.config_type.model_fields
    for load in (stage_class, stage_config_type):
        with pytest.raises(ValueError, match="valid: rollout, reward, reference, aggregate, "
                           "trainer, eval"):
            load("colocate")


def test_every_declared_run_topic_is_in_the_run_s_one_list():
    """Each contract stage's declared topics (inputs, outputs, error outputs) of run ``r``
    are in :func:`relax.schemas.topics.run_topic_partitions` with the count it declares:
    the declarations name topics through the one list and never add one (the shared
    ``prompts.<dataset>`` is not a run's). The e2e twin: test_pipeline's tiny run."""
    from types import SimpleNamespace

    from relax.consumers.aggregate import AggregateStage
    from relax.consumers.aggregate_config import AdvantageConfig, AggregateConfig
    from relax.consumers.reference import ReferenceStage
    from relax.consumers.reference_config import ReferenceConfig
    from relax.consumers.reward.stage import RewardStage, RewardStageConfig
    from relax.consumers.rollout.config import RolloutConfig
    from relax.consumers.rollout.stage import RolloutStage

    parts = 3
    listed = topics.run_topic_partitions("r", parts)
    stages = [
        RolloutStage(RolloutConfig(run="r", dataset="d", rollouts_partitions=parts,
                                   environment="calculator", environment_reward="env"),
                     engine=SimpleNamespace(tokenizer=None)),
        RewardStage(RewardStageConfig(run="r", reward="gsm8k"), None),
        ReferenceStage(ReferenceConfig(run="r"), None, model=_TinyModel()),
        ReferenceStage(ReferenceConfig(run="r", role="teacher", member_id="teacher-0"), None,
                       model=_TinyModel()),
        AggregateStage(AggregateConfig(run="r", partitions=parts, advantage=AdvantageConfig(
            ref_logprobs=True, distill_coef=0.1)), None),
    ]
    seen = set()
    for s in stages:
        d = s.declare()
        declared = {t: d.input.partitions for t in d.input.topics}
        declared.update({o.topic: o.partitions for o in d.outputs})
        declared.update({t: 1 for t in d.error_topics()})
        for t, n in declared.items():
            if t.startswith("prompts."):
                continue
            assert t in listed, f"{s.kind} declares {t}, which the run's list lacks"
            assert n is None or n == listed[t], (s.kind, t, n, listed[t])
            seen.add(t)
    # every co-partitioned data topic and the internal logs of the stages are declared
    assert {f"r.{n}" for n in ("rollouts", "rewards", "ref_logprobs", "teacher_logprobs",
                               "train_samples", "aggregate_changelog", "rollout_state",
                               "rollout_claims")} <= seen


class _TinyModel:
    """Stands in for a loaded model where only the declarations are read."""

    def eval(self):
        return self

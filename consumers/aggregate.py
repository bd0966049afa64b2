"""The aggregator: joins rollouts, rewards and reference (and teacher) log-probs per GRPO
group and emits train samples with advantages.

Input: ``<run>.rollouts``, ``<run>.rewards``, (when KL needs them) ``<run>.ref_logprobs``
and (on-policy distillation) ``<run>.teacher_logprobs``, all keyed by group_id with the
same partition count, read in consumer group ``<run>.aggregate``. The range assignor
gives an instance the same partition numbers of every input topic, so every row of a
group meets in one instance. Output: ``<run>.train_samples`` (keyed by
group_id), one row per rollout, ``drop_reason`` set on those not to train.

A group is emitted when it holds ``group_size`` rollouts, each with every counted
reward (and its reference and teacher log-probs when needed), or when ``group_timeout_s`` has
passed since its first row: then the complete rollouts form an uneven group
(public case C02) and the others are emitted with ``filtered_group_timeout``.
The counted rewards are the recipe's, changed live by ``<run>.reward_changes``
(:mod:`relax.consumers.reward.plan`): a group counts those of the plan at its group
policy_version. The aggregator keeps the scores of every reward name it sees (not only
the counted ones), so a reward attached live finds its earlier scores when its change
is read; it reads new changes at the start of every turn, and a (re)started
aggregator reads them all before its first turn.

State and delivery contract (at-least-once, restart loses nothing):

* Every accepted input row is appended to ``<run>.aggregate_changelog`` in the
  partition of its input, and an ``emitted`` marker follows each emitted group.
  Input offsets are committed only after the changelog records and the train
  samples of a poll are flushed.
* When the group assigns a partition, its state is rebuilt by reading the
  changelog partition to its fetch high watermark (``streams/read.py::read_partition``;
  faust tables were the plan, but their recovery reads to ``end_offsets``, which
  the local broker answers wrongly, so they would lose partial groups).
* Duplicates (redelivered inputs) are dropped by rollout_id; rows of an already
  emitted group are ignored, so a redelivered group is not emitted twice (a
  crash between flushing the samples and the marker can emit one twice: the
  trainer drops duplicates by rollout_id).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc

from relax.consumers.aggregate_config import AdvantageConfig, AggregateConfig
from relax.consumers.reward.changes import ChangeFollower
from relax.consumers.reward.plan import RewardPlan, group_policy_version
from relax.consumers.samples import RewardCell, build_train_samples
from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.streams.client import BusConfig
from relax.streams.codec import decode
from relax.streams.consumer import BatchConsumer
from relax.streams.metrics import MetricsWriter
from relax.streams.producer import BatchProducer
from relax.streams.read import read_partition
from relax.streams.stage import Output, process_once
from relax.streams.stage_contract import Declaration, Input, OutTopic, Stage, Wiring, run_stage

log = logging.getLogger(__name__)

EMITTED = b"emitted"
HEARTBEAT_S = 5.0
"""Seconds between the aggregator's metric rows when no input arrives (a stuck group
shows as a growing ``oldest_partial_s``)."""
CHANGES_EVERY_S = 2.0
"""Seconds between the aggregator's reads of new reward changes between versions (for
their ``reward_weight.<name>`` metric; the groups are decided on a read to the end, made
when a newer policy_version arrives): each read is a fetch round trip, and the
aggregator turns every ``poll_timeout_s`` while idle."""


@dataclass
class GroupState:
    """Partial join of one group: rollouts (one-row tables), reward cells, ref and teacher
    log-probs (``{rollout_id: [len(response_ids)] float}``)."""

    first_seen_s: float
    group_size: int = 0
    rollouts: dict[str, pa.Table] = field(default_factory=dict)
    rewards: dict[str, dict[str, RewardCell]] = field(default_factory=dict)
    ref: dict[str, list[float]] = field(default_factory=dict)
    teacher: dict[str, list[float]] = field(default_factory=dict)


class JoinState:
    """The join of one partition: pure bookkeeping, no I/O.

    Args:
        cfg: advantage configuration (the recipe's rewards, whether ref is needed).
        plan: the counted rewards per group policy_version (shared by the partitions);
            default: ``cfg.rewards`` at every version.
    """

    def __init__(self, cfg: AdvantageConfig, plan: RewardPlan | None = None):
        self.cfg = cfg
        self.plan = plan or RewardPlan(cfg.rewards)
        self.groups: dict[str, GroupState] = {}
        self.emitted: set[str] = set()
        self.duplicates = 0
        self.newest_version = -1  # the largest policy_version_start of a rollout added

    def add(self, schema: str, table: pa.Table, ts_s: float) -> pa.Table | None:
        """Apply rows of ``rollouts`` / ``rewards`` / ``ref_logprobs`` /
        ``teacher_logprobs``; returns the rows that changed the state (to write to the
        changelog), or None."""
        keep = []
        rows = table.to_pylist() if schema != "rollouts" else None
        for i in range(table.num_rows):
            gid = table.column("group_id")[i].as_py()
            if gid in self.emitted:
                self.duplicates += 1
                continue
            if schema == "ref_logprobs" and not self.cfg.needs_ref:
                continue
            if schema == "teacher_logprobs" and not self.cfg.needs_teacher:
                continue
            g = self.groups.get(gid)
            if g is None:
                g = self.groups[gid] = GroupState(first_seen_s=ts_s)
            rid = table.column("rollout_id")[i].as_py()
            if schema == "rollouts":
                if rid in g.rollouts:
                    self.duplicates += 1
                    continue
                g.rollouts[rid] = table.slice(i, 1)
                g.group_size = table.column("group_size")[i].as_py()
                self.newest_version = max(self.newest_version,
                                          table.column("policy_version_start")[i].as_py())
            elif schema == "rewards":
                r = rows[i]
                cells = g.rewards.setdefault(rid, {})
                if r["reward_name"] in cells:
                    self.duplicates += 1
                    continue
                cells[r["reward_name"]] = (r["value"], r["error"])
            else:
                held = g.teacher if schema == "teacher_logprobs" else g.ref
                if rid in held:
                    self.duplicates += 1
                    continue
                held[rid] = rows[i][schema]
            keep.append(i)
        if not keep:
            return None
        return table.take(pa.array(keep)) if len(keep) < table.num_rows else table

    def counted(self, g: GroupState) -> dict[str, float]:
        """The rewards (name -> weight) that count for group ``g``: the plan at its group
        policy_version (the recipe's while it has no rollout)."""
        if not g.rollouts:
            return self.cfg.rewards
        return self.plan.at(group_policy_version(
            [t.column("policy_version_start")[0].as_py() for t in g.rollouts.values()]))

    def _complete_ids(self, g: GroupState, names) -> list[str]:
        return [rid for rid in g.rollouts
                if all(n in g.rewards.get(rid, {}) for n in names)
                and (not self.cfg.needs_ref or rid in g.ref)
                and (not self.cfg.needs_teacher or rid in g.teacher)]

    def mark_emitted(self, gid: str) -> None:
        """Forget a group's state and remember it was emitted."""
        self.groups.pop(gid, None)
        self.emitted.add(gid)

    def take_ready(self, now_s: float, timeout_s: float) -> list[tuple[str, pa.Table]]:
        """Build train samples for groups that are complete or timed out, and mark them
        emitted. Returns ``[(group_id, train_samples table)]``."""
        out = []
        for gid, g in list(self.groups.items()):
            counted = self.counted(g)
            done = self._complete_ids(g, counted)
            complete = g.group_size > 0 and len(done) == g.group_size == len(g.rollouts)
            if not complete and now_s - g.first_seen_s < timeout_s:
                continue
            if not g.rollouts:  # results without any rollout: nothing to train
                self.mark_emitted(gid)
                continue
            timed_out = set(g.rollouts) - set(done)
            table = pa.concat_tables(list(g.rollouts.values()))
            cfg = self.cfg if counted == self.cfg.rewards else \
                self.cfg.model_copy(update={"rewards": counted})
            samples = build_train_samples(table, g.rewards, g.ref if self.cfg.needs_ref else None,
                                          cfg, timed_out=timed_out, teacher_logprobs=g.teacher)
            out.append((gid, samples))
            self.mark_emitted(gid)
        return out


class AggregateStage(Stage):
    """The aggregator as a process on the stage contract
    (:mod:`relax.streams.stage_contract`): ``AggregateStage(cfg, bus).run(should_stop)``.

    Args:
        cfg: aggregator configuration.
        bus: bus settings.
        instance: a name for this instance (producer id, metrics component).
    """

    kind = "aggregate"
    config_type = AggregateConfig

    def __init__(self, cfg: AggregateConfig, bus: BusConfig, instance: str = "aggregate-0"):
        self.cfg, self.bus, self.instance = cfg, bus, instance
        run = cfg.run
        self.inputs = [topics.run_topic(run, topics.ROLLOUTS), topics.run_topic(run, topics.REWARDS)]
        if cfg.advantage.needs_ref:
            self.inputs.append(topics.run_topic(run, topics.REF_LOGPROBS))
        if cfg.advantage.needs_teacher:
            self.inputs.append(topics.run_topic(run, topics.TEACHER_LOGPROBS))
        self.out_topic = topics.run_topic(run, topics.TRAIN_SAMPLES)
        self.changelog = topics.changelog_topic(run)
        self.states: dict[int, JoinState] = {}
        self.plan = RewardPlan(cfg.advantage.rewards)
        self._changes_at = 0.0  # time.monotonic() of the last read of the changes
        self._plan_through = -1  # changes were read to the end after a rollout of this version
        self._to_recover: set[int] = set()
        self.emitted_groups = 0
        self.emitted_rows = 0
        self._metrics_at = 0.0
        self._joined = False  # a delivery joined since the last metrics
        self.changes: ChangeFollower | None = None
        self.producer: BatchProducer | None = None
        self.consumer: BatchConsumer | None = None
        self.metrics: MetricsWriter | None = None

    def declare(self) -> Declaration:
        """Reads the rollouts, rewards (and, when needed, ref and teacher log-probs) in
        consumer group ``<run>.aggregate``, creating them with ``partitions``; writes
        ``<run>.train_samples`` and ``<run>.aggregate_changelog`` (``partitions``) and the
        inputs' error topics. The rebalance hooks rebuild and drop join state."""
        p = self.cfg.partitions
        return Declaration(
            run=self.cfg.run, component=self.instance, producer_id=self.instance,
            input=Input(tuple(self.inputs), topics.group(self.cfg.run, "aggregate"),
                        stage="aggregate", partitions=p, on_assign=self._assign,
                        on_revoke=self._revoke),
            outputs=(OutTopic(self.out_topic, p), OutTopic(self.changelog, p)))

    def build(self, w: Wiring) -> None:
        """Take the wiring and follow the run's reward changes."""
        self.producer, self.consumer, self.metrics = w.producer, w.consumer, w.metrics
        self.changes = ChangeFollower(self.bus, self.cfg.run)

    def _assign(self, tps) -> None:
        # runs on the consumer's I/O thread: only note it; turn() recovers the state
        self._to_recover.update(tp.partition for tp in tps)

    def _revoke(self, tps) -> None:
        for p in {tp.partition for tp in tps}:
            self.states.pop(p, None)
            self._to_recover.discard(p)

    def _recover(self, partition: int) -> JoinState:
        """Rebuild a partition's join state from its changelog partition."""
        t0 = time.monotonic()
        state = JoinState(self.cfg.advantage, self.plan)
        n = 0
        for m in read_partition(self.bus, self.changelog, partition):
            n += 1
            headers = dict(m.headers or [])
            if headers.get("relax-op") == EMITTED:
                state.mark_emitted(m.key.decode())
                continue
            schema = headers["relax-schema"].decode()
            state.add(schema, decode(m.value, schema), m.timestamp / 1000)
        log.info("recovered partition %d from %d changelog records in %.2fs: %d partial groups",
                 partition, n, time.monotonic() - t0, len(state.groups))
        return state

    def turn(self) -> int:
        """One turn (:func:`relax.streams.stage.process_once`): join each delivery
        (:meth:`_join`), emit the groups that are ready (:meth:`_emit`), flush, commit.
        Returns deliveries handled."""
        if time.monotonic() - self._changes_at >= CHANGES_EVERY_S:
            self._read_changes()
        return process_once(self.consumer, self.producer, self._join, stage="aggregate",
                            after=self._emit, poll_timeout_s=self.cfg.poll_timeout_s)

    def _read_changes(self, to_end: bool = False) -> None:
        """Apply newly announced reward changes to the plan (``to_end``: every change
        acknowledged so far, not only those fetched); each applied one goes to the
        metrics (``reward_weight.<name>``, 0 for a detach, at its from_policy_version)."""
        self._changes_at = time.monotonic()
        for c in self.changes.poll(to_end=to_end):
            refused = self.plan.apply(c)
            if refused:
                log.warning("reward change refused: %s", refused)
                continue
            log.info("reward change: %s %r weight %g from policy_version %d", c.action,
                     c.reward_name, c.weight, c.from_policy_version)
            self.metrics.add(M.REWARD_WEIGHT_PREFIX + c.reward_name, c.weight,
                             policy_version=c.from_policy_version)

    def _join(self, d) -> list[Output]:
        """Add one delivery to its partition's join state; its accepted rows go to the
        changelog partition that mirrors the input partition."""
        self._joined = True
        state = self.states.get(d.partition)
        if state is None:
            state = self.states[d.partition] = self._recover(d.partition)
        schema = d.headers.get("relax-schema", b"").decode() or topics.schema_for_topic(d.topic)
        changed = state.add(schema, d.table, d.timestamp_ms / 1000)
        if changed is None:
            return []
        return [Output(self.changelog, changed, schema=schema, partition=d.partition)]

    def _emit(self) -> None:
        """Recover newly assigned partitions, then send every group that is complete or
        timed out, and mark it emitted in the changelog once its samples are acknowledged."""
        for p in sorted(self._to_recover):
            if p not in self.states:
                self.states[p] = self._recover(p)
        self._to_recover.clear()
        newest = max((s.newest_version for s in self.states.values()), default=-1)
        if newest > self._plan_through:
            from kafka.errors import KafkaError

            # a change counting from version v was acknowledged before any rollout of v
            # was sampled (``changes.announce``), so a read to the end after one arrived
            # knows every change for the groups up to it: poll() alone may not have
            # fetched it yet (a CI run counted a detached reward for one group so)
            try:
                self._read_changes(to_end=True)
            except (TimeoutError, KafkaError) as e:  # the broker is away: decide nothing yet
                log.warning("reward changes not read to their end (%s): no group is "
                            "decided this turn", e)
                return
            self._plan_through = newest
        now = time.time()
        emitted: list[tuple[int, str]] = []
        for p, state in self.states.items():
            for gid, samples in state.take_ready(now, self.cfg.group_timeout_s):
                self.producer.send(self.out_topic, samples)
                emitted.append((p, gid))
                self.emitted_groups += 1
                self.emitted_rows += samples.num_rows
                timed_out = pc.sum(pc.equal(samples.column("drop_reason"),
                                            "filtered_group_timeout")).as_py() or 0
                if timed_out:  # what a stall looks like from here: say so in the log
                    log.info("group %s timed out after %.0fs: %d of %d rollouts lacked a "
                             "reward or ref/teacher log-probs", gid, self.cfg.group_timeout_s,
                             timed_out, samples.num_rows)
        if emitted:
            # the samples must be acknowledged before their groups are marked emitted: a
            # marker without its samples (a kill between the two) would lose the group
            self.producer.flush()
            for p, gid in emitted:
                self.producer.send_value(self.changelog, b"", key=gid.encode(),
                                         headers=[("relax-op", EMITTED)], partition=p)
        if self._joined or now - self._metrics_at >= HEARTBEAT_S:
            self._metrics_at, self._joined = now, False
            firsts = [g.first_seen_s for s in self.states.values() for g in s.groups.values()]
            self.metrics.add_many({M.GROUPS_EMITTED: self.emitted_groups,
                                   M.PARTIAL_GROUPS: len(firsts),
                                   M.OLDEST_PARTIAL_S: now - min(firsts) if firsts else 0.0})
            self.metrics.flush()

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Run turns until ``should_stop()`` (:func:`relax.streams.stage_contract.run_stage`)."""
        run_stage(self, should_stop)

    def close(self) -> None:
        """Stop following the reward changes (the contract closes the consumer, with no
        commit beyond what was flushed, and the producer)."""
        if self.changes is not None:
            self.changes.close()

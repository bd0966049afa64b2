"""The reward stage: ``<run>.rollouts`` -> one reward function -> ``<run>.rewards``.

Delivery contract (at-least-once, the same as :mod:`relax.streams.stage`):

* Input: ``<run>.rollouts`` in the consumer group ``<run>.reward.<name>``
  (:func:`relax.schemas.topics.reward_group`): each reward reads every rollout on its
  own, so attaching a reward to a live or finished run is starting one more consumer,
  and several instances with the same name share the partitions (scale-out).
* Output: one ``rewards`` row per rollout (``reward_name`` = the stage's name), keyed
  by group_id, so rewards are co-partitioned with their rollouts. A failed score is a
  row too: ``value`` null and ``error`` set (exception, timeout, memory limit, bad
  metadata JSON), counted in ``<run>.metrics`` (component ``reward.<name>``, names
  ``reward_errors``, ``reward_timeouts``, ... below; each poll's rows carry the newest
  policy_version_start of the poll); the stage never stops on one. A null ``value``
  without ``error`` is an abstention.
* Each poll's rows are scored together in the :class:`~relax.consumers.reward.pool.RewardPool`;
  outputs and metrics are flushed, then the input offsets are committed (the next
  offset to read). A crash in between redelivers the poll; downstream drops
  duplicates by (rollout_id, reward_name).
* Records that do not decode go to ``<run>.rollouts.errors`` (by the consumer).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relax.consumers.reward import default_reward_name, load_reward_fn
from relax.consumers.reward.pool import DEFAULT_MEMORY_LIMIT_BYTES, RewardPool, RowResult
from relax.schemas import metric_names, topics
from relax.schemas.v1 import REWARDS
from relax.streams.client import BusConfig
from relax.schemas.metric_names import (REWARD_ABSTAINS, REWARD_EXCEPTIONS,
                                        REWARD_MEMORY_ERRORS, REWARD_ROWS, REWARD_SCORE_S,
                                        REWARD_VALUE_MEAN, REWARD_WORKER_RESTARTS)
from relax.streams.metrics import MetricsWriter
from relax.streams.stage import StageStats, process_once
from relax.streams.stage_contract import (Declaration, Hooks, Input, OutTopic, Stage, Wiring,
                                          ensure_declared_topics, run_stage)

log = logging.getLogger(__name__)


class RewardStageConfig(BaseModel):
    """Settings of one reward consumer.

    Attributes:
        run: run name (reads ``<run>.rollouts``, writes ``<run>.rewards``).
        reward: a :data:`relax.consumers.reward.REWARD_FNS` name or ``module:function``.
        name: ``reward_name`` on the rows and in the consumer group
            ``<run>.reward.<name>``; default: the reward name or the function's name.
        options: keyword options of the reward function (JSON values).
        workers: scoring processes (>= 1).
        timeout_s: time limit of one scoring call (seconds).
        memory_limit_bytes: address-space limit of each worker (bytes); None = none.
        batch_rows: most rows per scoring call.
        from_beginning: where a new consumer group starts: earliest (True) or latest.
        poll_timeout_s: longest wait of one poll (seconds).
        max_records: most messages per poll (bounds the work between commits).
        exit_when_idle_s: stop after this many seconds without new rollouts once the
            consumer has partitions (scripts, tests); None = run until stopped.
        from_policy_version: score only rollouts with ``policy_version_start`` >= this
            (a reward attached live from that version: older groups never count it, so
            their rollouts are read, committed and not scored); 0 = all.
        startup_timeout_s: time a worker may take to load the function (seconds).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    run: str
    reward: str
    name: str | None = None
    options: dict = Field(default_factory=dict)
    workers: int = Field(1, ge=1)
    timeout_s: float = Field(30.0, gt=0)
    memory_limit_bytes: int | None = Field(DEFAULT_MEMORY_LIMIT_BYTES, ge=64 << 20)
    batch_rows: int = Field(64, ge=1)
    from_beginning: bool = True
    poll_timeout_s: float = Field(1.0, gt=0)
    max_records: int = Field(64, ge=1)
    exit_when_idle_s: float | None = Field(None, gt=0)
    from_policy_version: int = Field(0, ge=0)
    startup_timeout_s: float = Field(300.0, gt=0)

    @field_validator("run")
    @classmethod
    def _run_name(cls, v: str) -> str:
        return topics.check_name("run", v)

    @model_validator(mode="after")
    def _legal_reward_name(self) -> RewardStageConfig:
        self.reward_name  # noqa: B018  (raises ValueError for a name Kafka would reject)
        return self

    @property
    def reward_name(self) -> str:
        """The name written on rows and used in the consumer group."""
        return topics.check_name("reward", self.name or default_reward_name(self.reward))


def parse_metadata(raw: str | None) -> dict:
    """A rollout's metadata JSON as a dict (``{}`` for null or empty).

    Raises:
        ValueError: naming what was found when it is not a JSON object.
    """
    if not raw:
        return {}
    value = json.loads(raw)
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a JSON object, got {type(value).__name__}")
    return value


def reward_batch(table: pa.Table, results: list[RowResult], reward_name: str) -> pa.RecordBatch:
    """``rewards`` rows for the rollouts in ``table`` (``[N]`` rows) and their results
    (``[N]``, same order); values are cast to float32."""
    return pa.RecordBatch.from_pydict({
        "rollout_id": table.column("rollout_id").to_pylist(),
        "group_id": table.column("group_id").to_pylist(),
        "reward_name": [reward_name] * len(results),
        "value": [r.value for r in results],
        "details": [json.dumps(r.details, default=str) for r in results],
        "error": [r.error for r in results],
        "elapsed_s": [r.elapsed_s for r in results],
    }, schema=REWARDS)


def score_table(pool: RewardPool, table: pa.Table) -> list[RowResult]:
    """Score every rollout of ``table`` through ``pool``; a row whose metadata is not a
    JSON object gets an error result without being scored."""
    metas: list[dict | None] = []
    bad: dict[int, str] = {}
    for i, raw in enumerate(table.column("metadata").to_pylist()):
        try:
            metas.append(parse_metadata(raw))
        except ValueError as e:
            metas.append(None)
            bad[i] = f"bad metadata JSON: {e}"
    ok = [i for i in range(table.num_rows) if i not in bad]
    responses = table.column("response_text").to_pylist()
    labels = table.column("label").to_pylist()
    scored = pool.score([responses[i] for i in ok], [labels[i] for i in ok], [metas[i] for i in ok])
    results = [RowResult(None, {}, bad[i]) if i in bad else None for i in range(table.num_rows)]
    for i, r in zip(ok, scored):
        results[i] = r
    return results  # type: ignore[return-value]


class RewardStage(Stage):
    """One reward consumer (module docstring for the contract), on the stage contract
    (:mod:`relax.streams.stage_contract`).

    Usage: ``RewardStage(RewardStageConfig(run="exp1", reward="gsm8k"), bus).run(stop)``.

    Args:
        cfg: the settings.
        bus: how to reach the bus.

    Raises (at construction):
        ValueError: unknown reward or bad name (lists the valid ones).
    """

    kind = "reward"
    config_type = RewardStageConfig

    def __init__(self, cfg: RewardStageConfig, bus: BusConfig):
        load_reward_fn(cfg.reward)
        self.cfg, self.bus, self.name = cfg, bus, cfg.reward_name
        self.component = f"reward.{self.name}"
        self.rollouts = topics.run_topic(cfg.run, topics.ROLLOUTS)
        self.rewards = topics.run_topic(cfg.run, topics.REWARDS)
        self.stats = StageStats()
        self.pool: RewardPool | None = None
        self.w: Wiring | None = None
        self.assignment: set = set()
        """Partitions (``kafka.TopicPartition``) this instance owned at its last poll."""

    def declare(self) -> Declaration:
        """Reads ``<run>.rollouts`` (which must exist) in ``<run>.reward.<name>``; writes
        ``<run>.rewards`` co-partitioned with it, and ``<run>.rollouts.errors``."""
        return Declaration(
            run=self.cfg.run, component=self.component, producer_id=self.component,
            input=Input((self.rollouts,), topics.reward_group(self.cfg.run, self.name),
                        stage=self.component, from_beginning=self.cfg.from_beginning,
                        must_exist=True),
            outputs=(OutTopic(self.rewards),))

    def ensure_topics(self) -> None:
        """Create the output topics that are missing: ``<run>.rewards`` with the
        partition count of ``<run>.rollouts`` (co-partitioned) and ``<run>.rollouts.errors``
        with one (:func:`relax.streams.stage_contract.ensure_declared_topics`).

        Raises:
            ValueError: when ``<run>.rollouts`` does not exist (names it), or the rewards
                topic exists with another partition count.
        """
        ensure_declared_topics(self.bus, self.declare())

    def build(self, w: Wiring) -> None:
        """Start the scoring pool.

        Raises:
            relax.consumers.reward.pool.RewardLoadError: the function does not load in
                a worker (bad options, import error, no start within the time limit).
        """
        cfg = self.cfg
        self.w = w
        self.pool = RewardPool(cfg.reward, cfg.options, workers=cfg.workers,
                               timeout_s=cfg.timeout_s, memory_limit_bytes=cfg.memory_limit_bytes,
                               batch_rows=cfg.batch_rows, startup_timeout_s=cfg.startup_timeout_s)

    def hooks(self) -> Hooks:
        """Ends after ``exit_when_idle_s`` idle while it owns partitions."""
        return Hooks(exit_when_idle_s=self.cfg.exit_when_idle_s,
                     idle_counts=lambda: bool(self.assignment))

    def close(self) -> None:
        """Stop the scoring pool."""
        if self.pool is not None:
            self.pool.close()

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> StageStats:
        """Consume, score, produce and commit until ``should_stop()`` is true (or the
        stage was idle for ``exit_when_idle_s``): :func:`relax.streams.stage_contract.run_stage`.

        Returns:
            the counters; ``errors`` counts rows written with an error (null value).

        Raises:
            ValueError: no ``<run>.rollouts`` topic (see :meth:`ensure_topics`).
            relax.consumers.reward.pool.RewardLoadError: see :meth:`build`.
        """
        return run_stage(self, should_stop)

    def turn(self) -> int:
        """One turn (:func:`relax.streams.stage.process_once` with :meth:`_score` as its
        batch function). Returns the number of deliveries (0 for an empty poll)."""
        w = self.w
        n = process_once(w.consumer, w.producer, batch_fn=lambda ds: self._score(ds, w.metrics),
                         stage=self.component, poll_timeout_s=self.cfg.poll_timeout_s,
                         max_records=self.cfg.max_records, stats=self.stats)
        self.assignment = set(w.consumer.kafka.assignment())
        return n

    def _score(self, deliveries: list, metrics: MetricsWriter) -> list[tuple]:
        """Score every rollout of the poll as one batch: the reward rows (one per
        rollout; a failed row has a null value and its error), with this batch's
        metrics queued on the same producer."""
        t0 = time.perf_counter()
        pool_before = dict(vars(self.pool.stats))
        table = pa.concat_tables([d.table for d in deliveries])
        if self.cfg.from_policy_version:
            table = table.filter(pc.greater_equal(table.column("policy_version_start"),
                                                  self.cfg.from_policy_version))
            if not table.num_rows:
                return []
        results = score_table(self.pool, table)
        busy = time.perf_counter() - t0
        errors = sum(1 for r in results if r.error is not None)
        self.stats.errors += errors
        values = [r.value for r in results if r.value is not None]
        delta = {k: v - pool_before[k] for k, v in vars(self.pool.stats).items()}
        version = max(table.column("policy_version_start").to_pylist())
        metrics.add_many({
            REWARD_ROWS: table.num_rows, metric_names.REWARD_ERRORS: errors,
            REWARD_ABSTAINS: sum(1 for r in results if r.value is None and r.error is None),
            metric_names.REWARD_TIMEOUTS: delta["timeouts"],
            REWARD_EXCEPTIONS: delta["exceptions"], REWARD_MEMORY_ERRORS: delta["memory_errors"],
            REWARD_WORKER_RESTARTS: delta["restarts"], REWARD_SCORE_S: busy,
            metric_names.REWARD_ROWS_PER_S: table.num_rows / max(busy, 1e-9),
        }, policy_version=version)
        if values:
            metrics.add(REWARD_VALUE_MEAN, sum(values) / len(values), version)
        metrics.flush()
        if errors:
            log.warning("%s: %d of %d rows failed, e.g. %s", self.component, errors,
                        table.num_rows, next(r.error for r in results if r.error))
        return [(self.rewards, reward_batch(table, results, self.name))]

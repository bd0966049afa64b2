"""The rollout stage: prompts in, sampled groups of rollouts out, under a staleness budget.

Flow: consume ``prompts.<dataset>`` in consumer group ``<run>.rollout``; render each
prompt with the chat template (``apply_chat_template(add_generation_prompt=True)``);
sample ``group_size`` (G) responses per prompt with the engine; write ``<run>.rollouts``
keyed by ``group_id = <prompt_id>:<epoch>`` (``rollout_id = <group_id>/<sample_index>``),
every row validated against ROLLOUTS before it is sent.

Delivery (at-least-once): a prompt message is marked done only after every group of
its rows was produced and flushed; then the finished prefix is committed. A crash
re-samples the uncommitted prompts (same group_ids); downstream drops duplicate
rollout_ids. A prompt row the stage cannot render (e.g. the chat template fails on its
messages) goes to ``prompts.<dataset>.errors``; the stage goes on.

Staleness budget (ARCHITECTURE section 4, ``schemas.versions.in_flight_budget``): at
most ``B = (max_staleness + 1) * batch_groups`` groups may be sampled and not yet
decided by the trainer. The stage counts the groups it started; the trainer's
progress comes from two sources: its policy_version ``V`` in ``<run>.weights``
announcements (it decides ``batch_groups`` groups per step) and its
``groups_consumed`` / ``groups_needed`` metrics on ``<run>.metrics`` (groups trained or
dropped as stale/filtered, and groups still needed to finish the run; see
``schemas.metric_names``). A new group starts only while ``started < consumed +
min(B, needed)`` with ``consumed = max((V - V0) * batch_groups, groups_consumed)``
counted since the stage started (``V0`` = the trainer version then, 0 for a new run).
Without the metrics this is ``started < (V - V0 + max_staleness + 1) * batch_groups``;
with them, groups the trainer dropped are replaced instead of stalling the run, and no
group beyond what the run still needs is sampled. While the budget is used up the stage
pauses its prompt partitions (keeping its group membership) and waits for an
announcement or new progress. Several rollout instances (``num_instances`` = n,
``instance_index`` = i) split the same global credit: instance i may start
``floor((C + n - 1 - i) / n)`` of ``C = consumed + min(B, needed)`` (the parts sum to
``C``), each counting only its own groups; Kafka gives each instance its own prompt
partitions. This is exact for n = 1 and balanced when the trainer consumes the
instances' groups evenly; an instance whose groups are consumed faster than its
share waits a little longer. After a restart an instance counts what its predecessor
(same ``engine_id``) started and the trainer has not decided yet as started by itself:
each instance records, on ``<run>.rollout_state`` after its groups are acknowledged,
how many groups it started and which of them came from prompt messages not yet
committed (those prompts come again after a restart and are skipped, not re-sampled).

Weights: with ``follow_weights`` the HF engine subscribes to the weight broadcast
(:class:`relax.streams.weights.WeightSubscriber`) and swaps at its safe points:
between generate calls (so without ``partial_rollout`` no sample mixes two versions;
a multi-turn group holds one version for all its turns), or with ``partial_rollout``
also between chunks, with per-token versions. No group starts while the engine's
weights (staged included) are more than ``max_staleness`` versions behind the announced
version (they would only be dropped as stale), for at most ``weights_wait_s``.

Epochs: when every prompt of a partition has been sampled and ``epochs`` allows, the
partition is read again from offset 0 with the epoch + 1 (``group_id`` carries the
epoch). This assumes the prompt topic is complete before the run starts. Each epoch
change is recorded on ``<run>.rollout_state`` before any offset of the new epoch is
committed (the local broker drops commit metadata, so the epoch cannot ride on the
offset), so a restarted instance goes on in the epoch of its committed offsets, not
at epoch 0, whose group_ids the trainer already decided.

Metrics (``<run>.metrics``, component = ``engine_id``; names from
``schemas.metric_names``): ``gen_tokens_per_s``, ``groups_in_flight``, ``budget_wait_s``
(cumulative seconds waiting for budget), ``groups_sampled``, and ``weight_wait_s``
(cumulative seconds waiting for announced weights).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, model_validator

from relax.consumers.engines.base import Engine, SamplingParams
from relax.consumers.multiturn import (
    Episode,
    TemplateError,
    prompt_messages,
    render_ids,
    run_episodes,
)
from relax.trainer.cores import BusyFlag
from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.schemas.v1 import ROLLOUTS
from relax.schemas.validate import validate
from relax.schemas.versions import in_flight_budget
from relax.streams.client import BusConfig, ensure_topics

log = logging.getLogger(__name__)


class RolloutConfig(BaseModel):
    """Settings of one rollout instance.

    Attributes:
        bus: bus settings.
        run: run name (topics ``<run>.*``, consumer group ``<run>.rollout``).
        dataset: prompt topic ``prompts.<dataset>``.
        model: model name/folder/Hub id (``smollm2-135m``, ``tiny-llama``, ...).
        engine: ``hf`` (transformers) or ``sglang`` (an SGLang server at ``sglang_url``).
        engine_id: this instance's id (rollout rows, metrics component, weight member id).
        device: HF engine device (default: cuda if available).
        group_size: G, samples per prompt.
        batch_groups: groups the trainer consumes per step.
        max_staleness: see the module docstring (0 = sync mode).
        groups_per_generate: groups sampled together in one engine call (batch = this * G).
        prompt_template: applied to a prompt's text before the chat template
            (``"{prompt}"`` = as is; e.g. ``"{prompt}\nReply with just the number."``);
            rows with ``messages`` are rendered from their messages.
        max_new_tokens / temperature / top_p / top_k / stop / seed: sampling settings
            (``seed`` + the group counter seeds each call; None = random).
        epochs: passes over the prompt topic.
        partial_rollout / chunk_tokens: allow weight swaps every ``chunk_tokens`` tokens.
        follow_weights: join the weight broadcast (HF engine), and start no group while the
            engine's weights are more than ``max_staleness`` versions behind the trainer's
            (such samples would only be dropped as stale); after ``weights_wait_s`` the
            stage goes on with the weights it has (logged).
        weights_rendezvous: ``tcp://host:port`` of the trainer's publisher, to join before
            its first announcement (default: learnt from the first announcement).
        environment: ``module:function`` returning a new environment per sample
            (multi-turn); None = single turn.
        max_turns / max_total_tokens: multi-turn budgets (turns; response tokens).
        instance_index / num_instances: this instance among the rollout instances.
        rollouts_partitions: partitions of ``<run>.rollouts`` if the stage creates it.
        poll_timeout_s: prompt poll timeout (seconds).
        metrics_every_s: seconds between metric flushes.
        from_beginning: where a new consumer group starts on the prompt topic.
        busy_dir: folder of the run's busy flags: each engine call is marked there so a
            co-located trainer can take the idle core (``relax.trainer.cores``); None = off.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    bus: BusConfig
    run: str
    dataset: str
    model: str = "tiny-llama"
    engine: Literal["hf", "sglang"] = "hf"
    sglang_url: str | None = None
    engine_id: str = "rollout-0"
    device: str | None = None
    group_size: int = Field(4, ge=1)
    batch_groups: int = Field(8, ge=1)
    max_staleness: int = Field(1, ge=0)
    groups_per_generate: int = Field(1, ge=1)
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    stop: tuple[str, ...] = ()
    seed: int | None = None
    prompt_template: str = "{prompt}"
    epochs: int = Field(1, ge=1)
    partial_rollout: bool = False
    chunk_tokens: int = Field(32, ge=1)
    follow_weights: bool = True
    weights_rendezvous: str | None = None
    weights_wait_s: float = Field(300.0, gt=0)
    environment: str | None = None
    max_turns: int = Field(1, ge=1)
    max_total_tokens: int | None = Field(None, ge=1)
    instance_index: int = Field(0, ge=0)
    num_instances: int = Field(1, ge=1)
    rollouts_partitions: int = Field(1, ge=1)
    poll_timeout_s: float = Field(0.5, gt=0)
    metrics_every_s: float = Field(5.0, gt=0)
    from_beginning: bool = True
    busy_dir: str | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.instance_index >= self.num_instances:
            raise ValueError(
                f"instance_index {self.instance_index} must be < num_instances {self.num_instances}"
            )
        if self.engine == "sglang" and not self.sglang_url:
            raise ValueError("engine 'sglang' needs sglang_url (http://host:port)")
        topics.check_name("run", self.run)
        topics.check_name("dataset", self.dataset)
        try:
            self.prompt_template.format(prompt="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"prompt_template must use only {{prompt}}, got {self.prompt_template!r}: {e!r}"
            ) from None
        return self

    def sampling(self, seed: int | None = None) -> SamplingParams:
        """The :class:`SamplingParams` of one engine call."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=tuple(self.stop),
            seed=seed,
        )


@dataclass
class SavedState:
    """What ``<run>.rollout_state`` holds (see :data:`relax.schemas.topics.ROLLOUT_STATE`).

    Attributes:
        epochs: ``{(prompt topic, partition): epoch}``.
        started: ``{engine_id: groups started by that instance, all its incarnations}``.
        pending: ``{engine_id: group_ids it produced whose prompt messages were not yet
            committed}`` (a restart would get those prompts again).
    """

    epochs: dict[tuple[str, int], int] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)
    pending: dict[str, list[str]] = field(default_factory=dict)


def saved_state(bus: BusConfig, topic: str) -> SavedState:
    """Read ``<run>.rollout_state`` to its end: the latest record of each key wins (an
    empty state for a new run).

    Raises:
        ValueError: a record that is neither ``{topic, partition, epoch}`` nor
            ``{engine_id, started, pending}`` JSON (names its offset).
    """
    from relax.streams.changelog import read_partition

    out = SavedState()
    for m in read_partition(bus, topic, 0):
        try:
            r = json.loads(m.value)
            if "epoch" in r:
                out.epochs[(r["topic"], int(r["partition"]))] = int(r["epoch"])
            else:
                out.started[r["engine_id"]] = int(r["started"])
                out.pending[r["engine_id"]] = [str(g) for g in r["pending"]]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{topic}@{m.offset}: expected {{topic, partition, epoch}} or "
                             f"{{engine_id, started, pending}} JSON, got {m.value[:80]!r}: "
                             f"{e}") from e
    return out


def share(total: int, instance_index: int = 0, num_instances: int = 1) -> int:
    """Instance ``instance_index``'s part of ``total`` split over ``num_instances``
    (near-equal parts that sum to ``total``)."""
    return (total + num_instances - 1 - instance_index) // num_instances


def instance_budget(
    trainer_version: int,
    base_version: int,
    max_staleness: int,
    batch_groups: int,
    instance_index: int = 0,
    num_instances: int = 1,
    groups_consumed: int | None = None,
    groups_needed: int | None = None,
) -> int:
    """Groups instance ``instance_index`` may have started in all (since it started).

    ``consumed`` = groups the trainer decided since then: ``groups_consumed`` (trained or
    dropped, from the trainer's metrics) when known, else ``batch_groups`` per
    policy_version since ``base_version`` (a trainer that reports no progress). The run
    may have ``consumed + min(B, needed)`` groups started,
    ``B = in_flight_budget(max_staleness, batch_groups)`` and ``needed``
    the groups the trainer still needs (unlimited when unknown); this instance gets its
    :func:`share` of that (see the module docstring)."""
    if groups_consumed is not None:
        # the trainer's own count, paired with the ``needed`` of the same report: mixing
        # it with a count inferred from a newer policy_version would let the stage start
        # groups the run never trains
        consumed = groups_consumed
    else:
        consumed = max(0, trainer_version - base_version) * batch_groups
    cap = in_flight_budget(max_staleness, batch_groups)
    if groups_needed is not None:
        cap = min(cap, max(0, groups_needed))
    return share(consumed + cap, instance_index, num_instances)


WEIGHT_WAIT_S = "weight_wait_s"
"""Metric: seconds the stage waited for announced weights to arrive (cumulative)."""


class TrainerProgress:
    """The trainer's ``groups_consumed`` / ``groups_needed`` metrics (component
    ``trainer`` on ``<run>.metrics``), read group-less from the beginning: the rollout
    stage's credit. ``consumed`` and ``needed`` are the latest values (the trainer is
    their only writer, on one partition, so the latest is the truth even when a
    restarted trainer goes back to its checkpoint's count), ``version`` the trainer's
    policy_version when it wrote them (all None until the trainer wrote one).
    Undecodable records are skipped (logged)."""

    def __init__(self, cfg: BusConfig, run: str):
        from kafka import KafkaConsumer, TopicPartition

        from relax.streams.client import consumer_kwargs, topic_partitions

        self.topic = topics.run_topic(run, topics.METRICS)
        n = topic_partitions(cfg, [self.topic]).get(self.topic, 0)
        if not n:
            ensure_topics(cfg, {self.topic: 1})
            n = 1
        self._kc = KafkaConsumer(**consumer_kwargs(cfg, None))
        tps = [TopicPartition(self.topic, p) for p in range(n)]
        self._kc.assign(tps)
        self._kc.seek_to_beginning(*tps)
        self.consumed: int | None = None
        self.needed: int | None = None
        self.version: int | None = None

    def poll(self, timeout_s: float = 0.0) -> None:
        """Read what arrived (waiting up to ``timeout_s``)."""
        from relax.streams.codec import DecodeError, decode

        for msgs in self._kc.poll(timeout_ms=int(timeout_s * 1000)).values():
            for m in msgs:
                if m.key not in (None, b"trainer"):
                    continue
                try:
                    rows = decode(m.value, "metrics").to_pylist()
                except (DecodeError, ValueError) as e:
                    log.warning(
                        "skipping undecodable metrics record %s@%d: %s", self.topic, m.offset, e
                    )
                    continue
                for r in rows:
                    if r["component"] != "trainer":
                        continue
                    if r["name"] == M.GROUPS_CONSUMED:
                        self.consumed = int(r["value"])
                        if r["policy_version"] is not None:
                            self.version = int(r["policy_version"])
                    elif r["name"] == M.GROUPS_NEEDED:
                        self.needed = int(r["value"])

    def close(self) -> None:
        """Close the Kafka client."""
        self._kc.close(autocommit=False)


def load_environment_factory(spec: str) -> Callable[[], object]:
    """``module:function`` -> the function (called once per sample for a new environment).

    Raises:
        ValueError: not of the form ``module:function`` or not found (names it).
    """
    mod, sep, fn = spec.partition(":")
    if not sep or not mod or not fn:
        raise ValueError(f"environment must be 'module:function', got {spec!r}")
    try:
        return getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"environment {spec!r} cannot be loaded: {e}") from e


def build_engine(cfg: RolloutConfig) -> Engine:
    """The engine a config asks for (HF loads the model; SGLang connects to its server)."""
    if cfg.engine == "hf":
        from relax.consumers.engines.hf import HFEngine

        return HFEngine(
            cfg.model,
            engine_id=cfg.engine_id,
            device=cfg.device,
            partial_rollout=cfg.partial_rollout,
            chunk_tokens=cfg.chunk_tokens,
        )
    from relax.consumers.engines.sglang import SGLangEngine
    from relax.trainer.models import load_tokenizer

    return SGLangEngine(cfg.sglang_url, load_tokenizer(cfg.model), engine_id=cfg.engine_id)


def _ms() -> int:
    return int(time.time() * 1000)


def rollout_batch(
    prompt_row: dict,
    group_id: str,
    samples: list[Episode],
    cfg: RolloutConfig,
    engine_id: str,
    started_at: int,
    finished_at: int,
) -> pa.RecordBatch:
    """ROLLOUTS rows of one group (validated).

    Raises:
        relax.schemas.validate.SchemaError: a row breaks the schema (a bug: never sent).
    """
    rows = []
    for k, e in enumerate(samples):
        rows.append(
            dict(
                rollout_id=f"{group_id}/{k}",
                group_id=group_id,
                prompt_id=prompt_row["prompt_id"],
                dataset=prompt_row["dataset"],
                sample_index=k,
                group_size=len(samples),
                prompt_ids=e.prompt_ids,
                response_ids=e.response_ids,
                loss_mask=e.loss_mask,
                logprobs=e.logprobs,
                token_policy_versions=e.token_policy_versions if e.versions_recorded else None,
                policy_version_start=e.policy_version_start,
                policy_version_end=e.policy_version_end,
                finish_reason=e.finish_reason,
                turns=[{"role": t["role"], "start": t["start"], "end": t["end"]} for t in e.turns],
                prompt_text=prompt_row["prompt"],
                response_text=e.response_text,
                label=prompt_row.get("label"),
                metadata=_metadata(prompt_row, e),
                media=prompt_row.get("media"),
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                engine_id=engine_id,
                started_at=started_at,
                finished_at=finished_at,
            )
        )
    batch = pa.RecordBatch.from_pylist(rows, schema=ROLLOUTS)
    validate(batch, "rollouts")
    return batch


def _metadata(prompt_row: dict, e: Episode) -> str:
    if not e.rewards:
        return prompt_row["metadata"]
    meta = json.loads(prompt_row["metadata"] or "{}")
    meta["env_rewards"] = e.rewards
    return json.dumps(meta)


def sample_groups(
    engine: Engine, prompts: list[list[int]], group_size: int, params: SamplingParams
) -> list[list[Episode]]:
    """``group_size`` samples of each prompt in one engine call; ``[groups][G]`` episodes."""
    gens = engine.generate([p for p in prompts for _ in range(group_size)], params)
    out = []
    for gi, p in enumerate(prompts):
        group = []
        for g in gens[gi * group_size : (gi + 1) * group_size]:
            n = len(g.token_ids)
            group.append(
                Episode(
                    prompt_ids=list(p),
                    response_ids=list(g.token_ids),
                    loss_mask=[1] * n,
                    logprobs=list(g.logprobs),
                    token_policy_versions=list(g.token_policy_versions or []),
                    versions_recorded=g.token_policy_versions is not None,
                    policy_version_start=g.policy_version_start,
                    policy_version_end=g.policy_version_end,
                    finish_reason=g.finish_reason,
                    turns=[{"role": "assistant", "start": 0, "end": n}],
                    texts=[g.text],
                )
            )
        out.append(group)
    return out


@dataclass
class _Item:
    """One prompt row waiting to be sampled, and the delivery it came in."""

    delivery: object
    row: dict
    epoch: int


@dataclass
class RolloutStats:
    """Counters of one rollout instance."""

    groups: int = 0
    samples: int = 0
    tokens: int = 0
    generate_s: float = 0.0
    budget_waits: int = 0
    budget_wait_s: float = 0.0
    weight_waits: int = 0
    weight_wait_s: float = 0.0
    prompt_errors: int = 0
    epochs_started: int = 0
    repeated_prompts: int = 0


class RolloutStage:
    """One rollout instance: ``RolloutStage(cfg).run(should_stop)``.

    Args:
        cfg: the settings.
        engine: an engine to use instead of building one from ``cfg`` (tests, sharing).
    """

    def __init__(self, cfg: RolloutConfig, engine: Engine | None = None):
        self.cfg = cfg
        self.engine = engine if engine is not None else build_engine(cfg)
        self.tokenizer = self.engine.tokenizer
        self.prompts_topic = topics.prompts_topic(cfg.dataset)
        self.rollouts_topic = topics.run_topic(cfg.run, topics.ROLLOUTS)
        self.stats = RolloutStats()
        self.trainer_version: int | None = None
        self.base_version: int | None = None
        self.groups_started = 0
        self._env_factory = load_environment_factory(cfg.environment) if cfg.environment else None
        self._queue: list[_Item] = []
        self._remaining: dict[tuple, int] = {}
        self._epoch: dict = {}
        self._state_topic = topics.rollout_state_topic(cfg.run)
        self._revoked: set = set()  # prompt partitions taken away by a rebalance (I/O thread)
        self._saved = SavedState()
        self._started_total = 0  # groups this engine_id started, all its incarnations
        self._pending_gids: dict[tuple, list[str]] = {}  # prompt message -> groups produced
        self._exhausted: set = set()
        self._subscriber = None
        self._behind_since: float | None = None
        self._warned_behind = False
        self._progress: TrainerProgress | None = None
        self._consumed0 = 0
        self._started_ids: set[str] = set()
        self._busy = BusyFlag(cfg.busy_dir, cfg.engine_id) if cfg.busy_dir else None

    # ---------------------------------------------------------------- budget
    def _consumed(self) -> int | None:
        p = self._progress
        if p is None or p.consumed is None:
            return None
        return max(0, p.consumed - self._consumed0)

    def budget(self) -> int:
        """Groups this instance may still start now."""
        allowed = instance_budget(
            self.trainer_version or 0,
            self.base_version or 0,
            self.cfg.max_staleness,
            self.cfg.batch_groups,
            self.cfg.instance_index,
            self.cfg.num_instances,
            groups_consumed=self._consumed(),
            groups_needed=None if self._progress is None else self._progress.needed,
        )
        return allowed - self.groups_started

    def groups_in_flight(self) -> int:
        """Groups this instance started that the trainer has not decided yet (its share)."""
        consumed = max(0, (self.trainer_version or 0) - (self.base_version or 0))
        consumed *= self.cfg.batch_groups
        consumed = max(consumed, self._consumed() or 0)
        mine = share(consumed, self.cfg.instance_index, self.cfg.num_instances)
        return max(0, self.groups_started - mine)

    def _learn(self, reader, timeout_s: float) -> None:
        """Read announcements (waiting up to ``timeout_s``) and trainer progress."""
        self._read_announcements(reader, timeout_s)
        if self._progress is not None:
            self._progress.poll(0.0)

    def _idle(self, consumer, wait: Callable[[], object]) -> None:
        """Wait without taking prompts: pause the assigned partitions, poll (the group
        stays alive; partitions assigned by a rebalance just now may still deliver: those
        are queued), run ``wait``, resume."""
        kc = consumer.kafka
        assigned = list(kc.assignment())
        kc.pause(*assigned)
        try:
            self._enqueue(consumer, consumer.poll(0))
            wait()
        finally:
            kc.resume(*assigned)

    def weights_needed(self) -> int | None:
        """The oldest policy_version a group started now may be sampled with: it will be
        consumed ``in_flight // batch_groups`` steps after the trainer's current version
        (the groups already in flight go first), and must then have staleness <=
        max_staleness. None when the trainer's version is unknown."""
        versions = [v for v in (self.trainer_version,
                                None if self._progress is None else self._progress.version)
                    if v is not None]
        if not versions:
            return None
        ahead = self.groups_in_flight() * self.cfg.num_instances // self.cfg.batch_groups
        return max(versions) + ahead - self.cfg.max_staleness

    def _weights_behind(self) -> bool:
        """The engine's weights (staged included) are older than :meth:`weights_needed`
        (a group started now would be dropped as stale), and ``weights_wait_s`` has not
        run out."""
        need = self.weights_needed()
        if self._subscriber is None or need is None:
            return False
        have = max(self.engine.policy_version, getattr(self.engine, "pending_version", None) or 0)
        if have >= need:
            self._behind_since, self._warned_behind = None, False
            return False
        now = time.monotonic()
        self._behind_since = self._behind_since or now
        if now - self._behind_since > self.cfg.weights_wait_s:
            if self._warned_behind:
                return False
            self._warned_behind = True
            log.warning(
                "%s: weights v%d are older than the v%d a new group needs after %.0fs; "
                "sampling anyway",
                self.cfg.engine_id,
                have,
                need,
                self.cfg.weights_wait_s,
            )
            return False
        return True

    def _read_announcements(self, reader, timeout_s: float) -> None:
        reader.poll(timeout_s)
        if reader.latest_version is not None:
            self.trainer_version = max(self.trainer_version or 0, reader.latest_version)

    # ---------------------------------------------------------------- prompts
    def _key(self, d) -> tuple:
        return (d.topic, d.partition, d.offset)

    def _fetch(self, consumer) -> None:
        self._enqueue(consumer, consumer.poll(self.cfg.poll_timeout_s))
        if not self._queue:
            self._maybe_next_epoch(consumer)

    def _drop_revoked(self) -> None:
        """Forget the queued prompts of partitions a rebalance took away: their new owner
        samples them (sampling them here too would spend credit on duplicates)."""
        if not self._revoked:
            return
        gone, self._revoked = {(tp.topic, tp.partition) for tp in self._revoked}, set()
        self._queue = [i for i in self._queue if (i.delivery.topic, i.delivery.partition) not in gone]
        self._remaining = {k: n for k, n in self._remaining.items() if k[:2] not in gone}
        self._pending_gids = {k: g for k, g in self._pending_gids.items() if k[:2] not in gone}

    def _enqueue(self, consumer, deliveries) -> None:
        from kafka import TopicPartition

        self._drop_revoked()
        for d in deliveries:
            tp = TopicPartition(d.topic, d.partition)
            epoch = self._epoch.setdefault(tp, self._saved.epochs.get((tp.topic, tp.partition), 0))
            rows = d.table.to_pylist()
            if not rows:
                consumer.done(d)
                continue
            self._remaining[self._key(d)] = len(rows)
            self._queue.extend(_Item(d, r, epoch) for r in rows)

    def _maybe_next_epoch(self, consumer) -> None:
        """Rewind partitions whose prompts were all sampled, if ``epochs`` allows."""
        from kafka.structs import OffsetAndMetadata

        kc = consumer.kafka
        for tp in kc.assignment():
            hw = kc.highwater(tp)
            if hw is None or kc.position(tp) < hw or tp in self._exhausted:
                continue
            if any(k[0] == tp.topic and k[1] == tp.partition for k in self._remaining):
                continue
            epoch = self._epoch.setdefault(tp, self._saved.epochs.get((tp.topic, tp.partition), 0))
            if epoch + 1 >= self.cfg.epochs:
                self._exhausted.add(tp)
                continue
            consumer.commit()
            # the new epoch is durable before any offset of it is committed: a restart
            # never samples an epoch's group_ids twice (at worst, killed between the two
            # writes, it skips that epoch)
            self._producer.send_value(self._state_topic, json.dumps(
                {"topic": tp.topic, "partition": tp.partition, "epoch": epoch + 1}).encode(),
                key=f"{tp.topic}:{tp.partition}".encode())
            self._producer.flush()
            consumer._tracker.forget([tp])  # offsets restart at 0 for the next epoch
            kc.seek(tp, 0)
            kc.commit({tp: OffsetAndMetadata(0, "", -1)})
            self._epoch[tp] = epoch + 1
            self.stats.epochs_started += 1
            log.info("%s: %s[%d] epoch %d", self.cfg.engine_id, tp.topic, tp.partition, epoch + 1)

    def exhausted(self, consumer) -> bool:
        """Every prompt partition assigned to ``consumer`` has been sampled for all epochs
        and nothing is queued (False while no partition is assigned)."""
        assigned = consumer.kafka.assignment()
        return (
            bool(assigned)
            and all(tp in self._exhausted for tp in assigned)
            and not self._queue
            and not self._remaining
        )

    # ---------------------------------------------------------------- sampling
    def _templated(self, row: dict) -> dict:
        if self.cfg.prompt_template == "{prompt}":
            return row
        return {**row, "prompt": self.cfg.prompt_template.format(prompt=row["prompt"])}

    def _render(self, item: _Item) -> list[int]:
        return render_ids(self.tokenizer, prompt_messages(self._templated(item.row)))

    def _sample(self, items: list[_Item], prompt_ids: list[list[int]]) -> list[list[Episode]]:
        with self._busy.busy() if self._busy else contextlib.nullcontext():
            return self._sample_now(items, prompt_ids)

    def _sample_now(self, items: list[_Item], prompt_ids: list[list[int]]) -> list[list[Episode]]:
        seed = None if self.cfg.seed is None else self.cfg.seed + self.groups_started
        params = self.cfg.sampling(seed)
        if self._env_factory is None:
            return sample_groups(self.engine, prompt_ids, self.cfg.group_size, params)
        out = []
        for item in items:
            envs = [self._env_factory() for _ in range(self.cfg.group_size)]
            out.append(
                run_episodes(
                    self.engine,
                    self.tokenizer,
                    envs,
                    self._templated(item.row),
                    params,
                    max_turns=self.cfg.max_turns,
                    max_total_tokens=self.cfg.max_total_tokens,
                )
            )
        return out

    def process_once(self, consumer, producer, reader) -> int:
        """One turn: learn the trainer's version, fetch prompts if needed, sample up to
        ``groups_per_generate`` groups within the budget, produce, flush, commit.

        Returns:
            groups produced (0 when waiting for prompts or for budget).
        """
        self._learn(reader, 0.0)
        if self._weights_behind():
            self.stats.weight_waits += 1
            t0 = time.perf_counter()
            self._idle(consumer, lambda: self._subscriber.poll(self.cfg.poll_timeout_s))
            self.stats.weight_wait_s += time.perf_counter() - t0
            return 0
        left = self.budget()
        if left <= 0:
            self.stats.budget_waits += 1
            t0 = time.perf_counter()
            self._idle(consumer, lambda: self._learn(reader, self.cfg.poll_timeout_s))
            self.stats.budget_wait_s += time.perf_counter() - t0
            return 0
        if not self._queue:
            self._fetch(consumer)
        if not self._queue:
            return 0
        take = self._queue[: min(left, self.cfg.groups_per_generate)]
        items, prompt_ids = [], []
        for item in take:
            self._queue.remove(item)
            gid = f"{item.row['prompt_id']}:{item.epoch}"
            if gid in self._started_ids:  # a redelivered or repeated prompt: group exists
                self.stats.repeated_prompts += 1
                continue
            self._started_ids.add(gid)
            try:
                prompt_ids.append(self._render(item))
                items.append(item)
            except (TemplateError, ValueError, TypeError, KeyError) as e:
                self._route_prompt_error(producer, item, e)
        if items:
            self._produce(items, prompt_ids, producer)
        self._finish(consumer, take)
        return len(items)

    def _produce(self, items, prompt_ids, producer) -> None:
        started = _ms()
        t0 = time.perf_counter()
        self.groups_started += len(items)
        groups = self._sample(items, prompt_ids)
        self.stats.generate_s += time.perf_counter() - t0
        finished = _ms()
        for item, samples in zip(items, groups):
            group_id = f"{item.row['prompt_id']}:{item.epoch}"
            batch = rollout_batch(
                item.row, group_id, samples, self.cfg, self.cfg.engine_id, started, finished
            )
            producer.send(self.rollouts_topic, batch)
            self._pending_gids.setdefault(self._key(item.delivery), []).append(group_id)
            self.stats.groups += 1
            self.stats.samples += len(samples)
            self.stats.tokens += sum(sum(e.loss_mask) for e in samples)
        self._started_total += len(items)
        self._save_started(producer)

    def _save_started(self, producer) -> None:
        """Record the groups started and those whose prompts are not yet committed, after
        the groups themselves are acknowledged: a successor then neither loses their
        credit nor samples their prompts again (a record lost in a kill is harmless: the
        successor re-samples exactly the groups it does not count)."""
        producer.flush()
        pending = [g for gids in self._pending_gids.values() for g in gids]
        producer.send_value(self._state_topic, json.dumps(
            {"engine_id": self.cfg.engine_id, "started": self._started_total,
             "pending": pending}).encode(), key=f"started:{self.cfg.engine_id}".encode())
        producer.flush()

    def _route_prompt_error(self, producer, item: _Item, e: Exception) -> None:
        from relax.streams.codec import encode
        from relax.streams.errors import error_row

        d = item.delivery
        self.stats.prompt_errors += 1
        producer.send_errors(
            d.topic,
            [
                error_row(
                    source_topic=d.topic,
                    source_partition=d.partition,
                    source_offset=d.offset,
                    row=None,
                    stage=f"rollout/{self.cfg.engine_id}",
                    error=f"prompt {item.row.get('prompt_id')!r} cannot be rendered: "
                    f"{type(e).__name__}: {e}",
                    key=d.key,
                    value=encode(d.table),
                    headers=list(d.headers.items()),
                )
            ],
        )

    def _finish(self, consumer, items: list[_Item]) -> None:
        done = []
        for item in items:
            k = self._key(item.delivery)
            if k not in self._remaining:  # its partition was revoked meanwhile
                continue
            self._remaining[k] -= 1
            if self._remaining[k] == 0:
                del self._remaining[k]
                self._pending_gids.pop(k, None)  # committed below
                done.append(item.delivery)
        if done:
            self._producer_flush()
            consumer.done(done)
            consumer.commit()

    def _producer_flush(self) -> None:
        self._producer.flush()

    # ---------------------------------------------------------------- run loop
    def ensure_topics(self) -> None:
        """Create ``<run>.rollouts`` (``rollouts_partitions``), ``<run>.metrics``,
        ``<run>.rollout_state`` and ``prompts.<dataset>.errors`` if missing (existing
        topics are left as they are)."""
        from relax.streams.client import topic_partitions

        metrics = topics.run_topic(self.cfg.run, topics.METRICS)
        errors = topics.errors_topic(self.prompts_topic)
        want = {self.rollouts_topic: self.cfg.rollouts_partitions, metrics: 1, errors: 1,
                self._state_topic: 1}
        have = topic_partitions(self.cfg.bus, list(want))
        todo = {t: n for t, n in want.items() if not have.get(t)}
        if todo:
            ensure_topics(self.cfg.bus, todo)

    def run(
        self, should_stop: Callable[[], bool] = lambda: False, *, stop_when_exhausted: bool = False
    ) -> RolloutStats:
        """Run until ``should_stop()`` (or, with ``stop_when_exhausted``, until every epoch
        of the assigned prompts was sampled); returns the counters."""
        from relax.streams.consumer import BatchConsumer
        from relax.streams.metrics import MetricsWriter
        from relax.streams.producer import BatchProducer
        from relax.streams.weights import AnnouncementReader, WeightSubscriber

        cfg = self.cfg
        self.ensure_topics()
        self._saved = saved_state(cfg.bus, self._state_topic)
        self._started_total = self._saved.started.get(cfg.engine_id, 0)
        # the groups of prompts that will come again were produced already: not again
        self._started_ids.update(self._saved.pending.get(cfg.engine_id, []))
        self._producer = producer = BatchProducer(cfg.bus, producer_id=f"{cfg.run}-{cfg.engine_id}")
        consumer = BatchConsumer(
            cfg.bus,
            topics.group(cfg.run, "rollout"),
            [self.prompts_topic],
            stage=f"rollout/{cfg.engine_id}",
            from_beginning=cfg.from_beginning,
            error_producer=producer,
            on_revoke=self._revoked.update,
        )
        reader = AnnouncementReader(cfg.bus, cfg.run)
        self._progress = TrainerProgress(cfg.bus, cfg.run)
        metrics = MetricsWriter(producer, cfg.run, cfg.engine_id)
        if cfg.follow_weights and hasattr(self.engine, "update_weights") and cfg.engine == "hf":
            self._subscriber = WeightSubscriber(
                cfg.bus,
                cfg.run,
                member_id=cfg.engine_id,
                target=self.engine,
                device=getattr(self.engine, "device", "cpu"),
                rendezvous=cfg.weights_rendezvous,
            ).start()
        try:
            self._learn(reader, 1.0)
            self._progress.poll(1.0)
            self.base_version = self.trainer_version or 0
            self.trainer_version = self.base_version
            self._consumed0 = self._progress.consumed or 0
            # what a predecessor started and the trainer has not decided is in flight: it
            # holds credit as if this instance had started it (exact for one instance)
            mine = share(self._consumed0, cfg.instance_index, cfg.num_instances)
            self.groups_started = max(0, self._started_total - mine)
            last_metrics, last_tokens, last_t = time.monotonic(), 0, time.monotonic()
            while not should_stop():
                if self._subscriber is not None:
                    self._subscriber.poll(0)  # raises if its thread died
                self.process_once(consumer, producer, reader)
                if stop_when_exhausted and self.exhausted(consumer):
                    break
                now = time.monotonic()
                if now - last_metrics >= cfg.metrics_every_s:
                    self._emit_metrics(metrics, (self.stats.tokens - last_tokens) / (now - last_t))
                    producer.flush()
                    last_metrics, last_tokens, last_t = now, self.stats.tokens, now
            self._emit_metrics(metrics, None)
            producer.flush()
            consumer.commit()
        finally:
            if self._subscriber is not None:
                self._subscriber.close()
            reader.close()
            self._progress.close()
            consumer.close()
            producer.close()
        return self.stats

    def _emit_metrics(self, metrics, tokens_per_s: float | None) -> None:
        v = getattr(self.engine, "policy_version", None)
        values = {
            M.GROUPS_IN_FLIGHT: self.groups_in_flight(),
            M.BUDGET_WAIT_S: self.stats.budget_wait_s,
            WEIGHT_WAIT_S: self.stats.weight_wait_s,
            M.GROUPS_SAMPLED: self.stats.groups,
        }
        if tokens_per_s is not None:
            values[M.GEN_TOKENS_PER_S] = tokens_per_s
        metrics.add_many(values, v)
        metrics.flush()

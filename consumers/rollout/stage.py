"""The rollout stage's loop (:class:`RolloutStage`): learn the trainer's progress, wait
for credit or weights, sample, produce, commit. See the package docstring
(:mod:`relax.consumers.rollout`) for the flow, delivery, budget, weights and epochs."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import relax.consumers.rollout.credit as credit
from relax.consumers.engines.base import Engine
from relax.consumers.environments import load_environment_factory
from relax.consumers.multiturn import (
    Episode,
    TemplateError,
    prompt_messages,
    render_ids,
    run_episodes,
)
from relax.consumers.rollout.claims import ClaimLog
from relax.consumers.rollout.config import RolloutConfig
from relax.consumers.rollout.errors import route_prompt_error
from relax.consumers.rollout.metrics import RolloutStats, emit_metrics
from relax.consumers.rollout.prompts import PromptItem, PromptQueue, message_key
from relax.consumers.rollout.sampling import (
    build_engine,
    environment_reward_batch,
    now_ms,
    rollout_batch,
    sample_groups,
    sample_sglang_media,
)
from relax.consumers.rollout.state import SavedState, saved_state
from relax.schemas import topics
from relax.streams.client import BusConfig
from relax.streams.progress import TrainerProgress
from relax.streams.stage_contract import (Declaration, Hooks, Input, OutTopic, Stage, Wiring,
                                          run_stage)
from relax.trainer.models import load_processor
from relax.trainer.multimodal import encode_prompt

log = logging.getLogger(__name__)


class RolloutStage(Stage):
    """One rollout instance on the stage contract (:mod:`relax.streams.stage_contract`):
    ``RolloutStage(cfg, bus).run(should_stop)``.

    Args:
        cfg: the settings.
        bus: bus settings (None: a stage whose logic is used without running it).
        engine: an engine to use instead of building one from ``cfg`` (tests, sharing).
    """

    kind = "rollout"
    config_type = RolloutConfig

    def __init__(self, cfg: RolloutConfig, bus: BusConfig | None = None,
                 engine: Engine | None = None):
        self.cfg, self.bus = cfg, bus
        self.engine = engine if engine is not None else build_engine(cfg)
        self.tokenizer = self.engine.tokenizer
        self.processor = load_processor(cfg.model)
        if self.processor is not None and cfg.engine == "sglang" and cfg.environment:
            raise ValueError(f"rollout.environment with the multimodal model {cfg.model} "
                             "on the SGLang engine: multi-turn media run on the HF engine only")
        self.prompts_topic = topics.prompts_topic(cfg.dataset)
        self.rollouts_topic = topics.run_topic(cfg.run, topics.ROLLOUTS)
        self.stats = RolloutStats()
        self.trainer_version: int | None = None
        self.groups_started = 0  # by this instance since it started
        self._claim_s = 0.0  # the last claim's round trip (logged with its generate call)
        self._env_factory = (load_environment_factory(cfg.environment, cfg.environment_options)
                             if cfg.environment else None)
        self.rewards_topic = topics.run_topic(cfg.run, topics.REWARDS)
        self._state_topic = topics.rollout_state_topic(cfg.run)
        self._prompts = PromptQueue(cfg, self._state_topic, self.stats)
        self._saved = SavedState()
        self._subscriber = None
        self._behind_since: float | None = None
        self._warned_behind = False
        self._progress: TrainerProgress | None = None
        self._claims: ClaimLog | None = None
        self._started_ids: set[str] = set()
        self._follower = None
        self._reader = None
        self._stop_when_exhausted = False
        self.w: Wiring | None = None

    # ---------------------------------------------------------------- budget
    def _granted(self) -> int:
        return 0 if self._claims is None else self._claims.granted

    def _reported(self, name: str) -> int | None:
        return None if self._progress is None else getattr(self._progress, name)

    def allowance(self) -> int:
        """Groups the run may have started in all (:func:`credit.run_allowance`)."""
        return credit.run_allowance(
            self.trainer_version or 0, self.cfg.max_staleness, self.cfg.batch_groups,
            groups_consumed=self._reported("consumed"), groups_needed=self._reported("needed"))

    def budget(self) -> int:
        """Groups any instance may still claim now (:func:`credit.credit_left` of the
        run's allowance and the claim log's grants)."""
        return credit.credit_left(self.allowance(), self._granted())

    def prompt_partitions(self) -> int:
        """Prompt partitions this instance holds now (its consumer group's assignment)."""
        return len(self._prompts.assigned)

    def groups_in_flight(self) -> int:
        """Groups of the run granted and not yet decided by the trainer
        (:func:`credit.groups_in_flight`)."""
        decided = credit.groups_decided(
            self.trainer_version or 0, self.cfg.batch_groups, self._reported("consumed"))
        return credit.groups_in_flight(self._granted(), decided)

    def _learn(self, reader, timeout_s: float) -> None:
        """Read announcements, trainer progress and claims, waiting up to ``timeout_s`` on
        what moves the credit (:func:`credit.groups_decided`): the progress once the trainer
        has reported, else the announcements (a sync run's generate waited 0.5 s on them)."""
        progress = self._progress is not None and self._progress.consumed is not None
        self._read_announcements(reader, 0.0 if progress else timeout_s)
        if self._progress is not None:
            self._progress.poll(timeout_s if progress else 0.0)
        if self._claims is not None:
            self._claims.poll(0.0)

    def _idle(self, consumer, wait: Callable[[], object]) -> None:
        """Wait without taking prompts: pause the assigned partitions, poll (the group
        stays alive; partitions assigned by a rebalance just now may still deliver: those
        are queued), run ``wait``, resume those still assigned (a rebalance during the
        poll, after a broker restart for one, may have revoked some: kafka-python raises
        KeyError when resuming a partition it no longer holds; new ones are not paused)."""
        kc = consumer.kafka
        assigned = list(kc.assignment())
        kc.pause(*assigned)
        try:
            self._prompts.enqueue(consumer, consumer.poll(0))
            wait()
        finally:
            held = kc.assignment()
            kc.resume(*[tp for tp in assigned if tp in held])

    def weights_needed(self) -> int | None:
        """The oldest policy_version a group started now may be sampled with: it will be
        consumed ``in_flight // batch_groups`` steps after the trainer's current version
        (the groups already in flight go first), and must then have staleness <=
        max_staleness. None when the trainer's version is unknown
        (:func:`credit.oldest_usable_version`)."""
        return credit.oldest_usable_version(
            self.trainer_version, None if self._progress is None else self._progress.version,
            self.groups_in_flight(), self.cfg.batch_groups, self.cfg.max_staleness)

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
            log.warning("%s: weights v%d are older than the v%d a new group needs after "
                        "%.0fs; sampling anyway", self.cfg.engine_id, have, need,
                        self.cfg.weights_wait_s)
            return False
        return True

    def _read_announcements(self, reader, timeout_s: float) -> None:
        reader.poll(timeout_s)
        if reader.latest_version is not None:
            self.trainer_version = reader.latest_version  # lower after a trainer restart

    # ---------------------------------------------------------------- prompts
    def exhausted(self, consumer) -> bool:
        """Every prompt partition assigned to ``consumer`` has been sampled for all epochs
        and nothing is queued (False while no partition is assigned)."""
        return self._prompts.exhausted(consumer)

    # ---------------------------------------------------------------- sampling
    def _templated(self, row: dict) -> dict:
        if self.cfg.prompt_template == "{prompt}":
            return row
        return {**row, "prompt": self.cfg.prompt_template.format(prompt=row["prompt"])}

    def _render(self, item: PromptItem) -> list[int]:
        """The prompt's token ids (a media prompt's expanded by the model's processor).

        Raises:
            ValueError: media for a text-only model, video for the SGLang engine; see
                ``encode_prompt``.
        """
        msgs = prompt_messages(self._templated(item.row))
        if item.row.get("media") and self.processor is None:
            raise ValueError(f"the row has {len(item.row['media'])} media items but "
                             f"{self.cfg.model} takes no images or audio")
        videos = sum(1 for it in item.row.get("media") or [] if it["kind"] == "video")
        if videos and self.cfg.engine == "sglang":
            raise ValueError(f"the row has {videos} video items; the SGLang engine is sent no "
                             "video (its server samples a clip itself, relax stores the "
                             "frames it sampled): run video on the HF engine")
        if self.processor is not None and item.row.get("media"):  # placeholders expanded
            ids, item.media_inputs = encode_prompt(self.processor, msgs, item.row["media"])
            return ids
        return render_ids(self.tokenizer, msgs)

    def _sample(self, items: list[PromptItem], prompt_ids: list[list[int]]) -> list[list[Episode]]:
        seed = None if self.cfg.seed is None else self.cfg.seed + self.groups_started
        params = self.cfg.sampling(seed)
        if self._env_factory is None and self.processor is not None:
            inputs = [it.media_inputs or {} for it in items]
            out: list = [None] * len(items)
            for with_media in (False, True):  # a batch of media prompts or of text ones
                idx = [i for i, p in enumerate(inputs) if bool(p) == with_media]
                if idx and with_media and self.cfg.engine == "sglang":
                    groups = sample_sglang_media(
                        self.engine, self.processor, [prompt_messages(self._templated(
                            items[i].row)) for i in idx], [items[i].row["media"] for i in idx],
                        [prompt_ids[i] for i in idx], self.cfg.group_size, params)
                elif idx:
                    groups = sample_groups(self.engine, [prompt_ids[i] for i in idx],
                                           self.cfg.group_size, params,
                                           [inputs[i] for i in idx] if with_media else None)
                    for i, g in zip(idx, groups):
                        out[i] = g
            return out
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
                    processor=self.processor,
                )
            )
        return out

    def _regrants(self) -> list[PromptItem]:
        """Queued prompts granted before and not started here (:meth:`PromptQueue.regrants`):
        the run's credit may be all spent on them, their claims holding it."""
        granted = set() if self._claims is None else self._claims.ledger.granted
        return self._prompts.regrants(granted, self._started_ids)

    def ready(self, reader) -> bool:
        """The readiness gate: the engine has the weights the trainer announced, and the
        credit lets this instance start a group, or a queued prompt's group was granted
        before (:meth:`_regrants`; learns the trainer's version first)."""
        self._learn(reader, 0.0)
        return not self._weights_behind() and (self.budget() > 0 or bool(self._regrants()))

    def wait(self, consumer, reader) -> None:
        """While the gate is closed: wait for the weights (for the trainer's progress while
        it lags its announcement: :func:`credit.report_lags`), or for credit (keeping the
        consumer group membership alive), and count the wait."""
        t0, timeout_s = time.perf_counter(), self.cfg.poll_timeout_s
        if self._weights_behind():
            self.stats.weight_waits += 1
            reported = getattr(self._progress, "version", None)
            lags = credit.report_lags(self.trainer_version, reported)
            self._idle(consumer, (lambda: self._learn(reader, timeout_s)) if lags
                       else (lambda: self._subscriber.poll(timeout_s)))
            self.stats.weight_wait_s += time.perf_counter() - t0
        else:
            self.stats.budget_waits += 1
            if self._prompts.items:
                self._idle(consumer, lambda: self._learn(reader, self.cfg.poll_timeout_s))
            else:  # take prompts meanwhile: those granted to a predecessor open the gate
                self._prompts.enqueue(consumer, consumer.poll(0))
                self._learn(reader, self.cfg.poll_timeout_s)
            self.stats.budget_wait_s += time.perf_counter() - t0

    def sample_turn(self, consumer, producer) -> int:
        """One turn once the gate (:meth:`ready`) is open: fetch prompts if needed,
        sample up to ``groups_per_generate`` groups within the credit, produce, flush,
        commit the prompts whose groups are all produced.

        Returns:
            groups produced (0 when waiting for prompts).
        """
        left = self.budget()
        queue = self._prompts
        if queue.items:
            # a poll with the held partitions paused: a rebalance (an instance joined or
            # left) completes within one engine call instead of after the whole queue,
            # and the prompts of a partition it took away are dropped before a claim
            self._idle(consumer, lambda: None)
        else:
            queue.fetch(consumer)
        if not queue.items:
            return 0
        take = self._regrants()[: self.cfg.groups_per_generate]
        if not take and left > 0:
            take = queue.items[: credit.groups_per_call(left, self.cfg.groups_per_generate)]
        wanted: dict[str, tuple[PromptItem, list[int]]] = {}
        for item in take:
            queue.items.remove(item)
            gid = item.group_id
            if gid in self._started_ids or gid in queue.others_pending or gid in wanted:
                # redelivered, repeated, or produced by another instance: exists
                self.stats.repeated_prompts += 1
                continue
            try:
                wanted[gid] = (item, self._render(item))
            except (TemplateError, ValueError, TypeError, KeyError) as e:
                self.stats.prompt_errors += 1
                route_prompt_error(producer, item, e, self.cfg.engine_id)
        t_claim = time.perf_counter()
        granted = set(self._claims.claim(list(wanted), self.allowance())) if wanted else set()
        self._claim_s = time.perf_counter() - t_claim
        back = [item for gid, (item, _) in wanted.items() if gid not in granted]
        queue.items[:0] = back  # another instance took that credit first: later
        self.stats.claims_refused += len(back)
        self._started_ids.update(granted)
        chosen = [v for gid, v in wanted.items() if gid in granted]
        if chosen:
            self._produce([i for i, _ in chosen], [ids for _, ids in chosen], producer)
        queue.finish(consumer, [item for item in take if item not in back])
        return len(chosen)

    def _produce(self, items, prompt_ids, producer) -> None:
        started = now_ms()
        t0 = time.perf_counter()
        self.groups_started += len(items)
        groups = self._sample(items, prompt_ids)
        took = time.perf_counter() - t0
        self.stats.generate_s += took
        finished = now_ms()
        for item, samples in zip(items, groups):
            group_id = item.group_id
            batch = rollout_batch(
                item.row, group_id, samples, self.cfg, self.cfg.engine_id, started, finished
            )
            producer.send(self.rollouts_topic, batch)
            if self.cfg.environment_reward:  # the episodes' rewards are real rewards
                producer.send(self.rewards_topic, environment_reward_batch(
                    batch, samples, self.cfg.environment_reward))
            self._prompts.pending_gids.setdefault(message_key(item.delivery), []).append(group_id)
            self.stats.groups += 1
            self.stats.samples += len(samples)
            self.stats.tokens += sum(sum(e.loss_mask) for e in samples)
        self._save_pending(producer)
        log.info("sampled %d groups in %.2f s (policy_version %s; claim %.3f s, produce "
                 "and flush %.3f s)", len(items), took,
                 getattr(self.engine, "policy_version", None), self._claim_s,
                 time.perf_counter() - t0 - took)

    def _save_pending(self, producer) -> None:
        """Record the groups whose prompts are not yet committed, after the groups
        themselves are acknowledged: a successor then does not sample those prompts again
        (a record lost in a kill is harmless: the successor re-samples exactly the groups
        it does not know of; the claim log keeps their credit)."""
        producer.flush()
        pending = [g for gids in self._prompts.pending_gids.values() for g in gids]
        pending += self._prompts.handed_gids
        producer.send_value(self._state_topic, json.dumps(
            {"engine_id": self.cfg.engine_id, "pending": pending}).encode(),
            key=f"started:{self.cfg.engine_id}".encode())
        producer.flush()

    # ---------------------------------------------------------------- run loop
    def declare(self) -> Declaration:
        """Reads ``prompts.<dataset>`` in consumer group ``<run>.rollout`` (the prompt
        queue's rebalance hooks); writes ``<run>.rollouts`` (``rollouts_partitions``),
        ``<run>.rollout_state`` and ``<run>.rollout_claims`` (1), ``<run>.rewards`` when it
        writes environment rewards
        (co-partitioned with the rollouts), ``prompts.<dataset>.errors``; existing topics
        are left as they are."""
        cfg = self.cfg
        outputs = [OutTopic(self.rollouts_topic, cfg.rollouts_partitions, strict=False),
                   OutTopic(self._state_topic, 1, strict=False),
                   OutTopic(topics.rollout_claims_topic(cfg.run), 1)]
        if cfg.environment_reward:  # co-partitioned with the rollouts, like rewards
            outputs.append(OutTopic(self.rewards_topic, cfg.rollouts_partitions, strict=False))
        return Declaration(
            run=cfg.run, component=cfg.engine_id, producer_id=f"{cfg.run}-{cfg.engine_id}",
            input=Input((self.prompts_topic,), topics.group(cfg.run, "rollout"),
                        stage=f"rollout/{cfg.engine_id}", from_beginning=cfg.from_beginning,
                        on_assign=self._prompts.note_assigned,
                        on_revoke=self._prompts.note_revoked),
            outputs=tuple(outputs))

    def build(self, w: Wiring) -> None:
        """Read the saved state, then make the stage's own followers: the announcements
        and the trainer's progress on one :class:`~relax.streams.follow.Follower`, the
        claim log, the weight subscriber (when ``follow_weights``); learn where the run is."""
        from relax.streams.follow import Follower
        from relax.streams.weights.announce import AnnouncementReader
        from relax.streams.weights.server import ServerSubscriber
        from relax.streams.weights.subscriber import WeightSubscriber

        cfg, bus = self.cfg, w.bus
        self.w = w
        self._saved = saved_state(bus, self._state_topic)
        self._prompts.saved_epochs = self._saved.epochs
        # the groups of prompts that will come again were produced already: not again.
        # Every engine's: after a scale-in or a rebalance, another instance's pending
        # prompts come here
        for pending in self._saved.pending.values():
            self._started_ids.update(pending)
        self._prompts.producer = w.producer
        # the announcements (twice: here and in the subscriber's thread) and the progress
        # on one client: one fetch loop while the stage waits (streams/follow.py)
        self._follower = follower = Follower(bus, f"rollout-{cfg.engine_id}")
        self._reader = AnnouncementReader(bus, cfg.run, follower)
        self._progress = TrainerProgress(bus, cfg.run, follower)
        self._claims = ClaimLog(bus, cfg.run, cfg.engine_id, w.producer)
        if cfg.follow_weights and getattr(self.engine, "receives_broadcast", False):
            self._subscriber = ServerSubscriber(  # an SGLang server joins the group itself
                bus, cfg.run, member_id=cfg.engine_id, target=self.engine,
                rendezvous=cfg.weights_rendezvous, follower=follower).start()
        elif cfg.follow_weights and hasattr(self.engine, "update_weights"):
            self._subscriber = WeightSubscriber(
                bus, cfg.run, member_id=cfg.engine_id, target=self.engine,
                device=getattr(self.engine, "device", "cpu"),
                rendezvous=cfg.weights_rendezvous, follower=follower).start()
        self._learn(self._reader, 1.0)
        self._progress.poll(1.0)
        self._rate = {"tokens": 0, "t": time.monotonic()}

    def hooks(self) -> Hooks:
        """The readiness gate (:meth:`ready`) and its wait (:meth:`wait`), the weight
        subscriber's error surfaced before each round, metrics every ``metrics_every_s``,
        the end of the prompts (with ``stop_when_exhausted``)."""
        consumer, reader = self.w.consumer, self._reader
        return Hooks(ready=lambda: self.ready(reader), wait=lambda: self.wait(consumer, reader),
                     before=self._surface_subscriber_error, periodic=self._periodic,
                     every_s=self.cfg.metrics_every_s,
                     done=lambda: self._stop_when_exhausted and self.exhausted(consumer))

    def turn(self) -> int:
        """One turn (:meth:`sample_turn` on the wiring's consumer and producer)."""
        return self.sample_turn(self.w.consumer, self.w.producer)

    def _periodic(self) -> None:
        now = time.monotonic()
        rate = self._rate
        self._emit_metrics(self.w.metrics, (self.stats.tokens - rate["tokens"]) / (now - rate["t"]))
        rate.update(tokens=self.stats.tokens, t=now)

    def finish(self) -> None:
        """The last metrics row (the contract then flushes and commits)."""
        self._emit_metrics(self.w.metrics, None)

    def close(self) -> None:
        """Close the weight subscriber, the readers, the claim log and the follower."""
        for part in (self._subscriber, self._reader, self._progress, self._claims,
                     self._follower):
            if part is not None:
                part.close()

    def run(
        self, should_stop: Callable[[], bool] = lambda: False, *, stop_when_exhausted: bool = False
    ) -> RolloutStats:
        """Run until ``should_stop()`` (or, with ``stop_when_exhausted``, until every epoch
        of the assigned prompts was sampled): :func:`relax.streams.stage_contract.run_stage`.
        Returns the counters."""
        self._stop_when_exhausted = stop_when_exhausted
        return run_stage(self, should_stop)

    def _surface_subscriber_error(self) -> None:
        if self._subscriber is not None:
            self._subscriber.poll(0)  # raises if its thread died

    def _emit_metrics(self, metrics, tokens_per_s: float | None) -> None:
        v = getattr(self.engine, "policy_version", None)
        emit_metrics(metrics, self.stats, self.groups_in_flight(), v, tokens_per_s)

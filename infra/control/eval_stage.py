"""The eval stage (``eval.every: N``): greedy held-out accuracy of the trainer's weights
every N policy_versions, while the run goes on.

Where it runs, and why: its own process, subscribed to the weight channel as the
reference stage is (:class:`~relax.streams.weights.subscriber.WeightSubscriber`).

* Not in the trainer: an eval there stops training for its length (it is generation,
  not a forward pass), the trainer layer may not import the engine and the reward pool
  (they are consumers), and a sharded trainer (FSDP, Megatron) holds no whole model to
  generate with.
* Not in the reference stage: the reference is off in most recipes (``kl`` 0), and an
  eval there holds back the ref log-probs the aggregator waits for.

What it costs: one more member of the weight broadcast, one more copy of the model (and
of each version waiting for its eval), the eval reward's one-worker pool, and the CPU or
GPU time of each eval, taken beside the other stages (on a CPU-only host the run slows
while an eval runs; ``resources.eval`` places and limits it like any stage). Measured on
2 loaded CPU cores: the stage's start ~20 s (~7 CPU-seconds, beside the other stages'
start), an eval of the tiny recipe's 4 prompts 0.03-0.2 s, the demo's 200 prompts x 12
tokens on SmolLM2-135M with one thread 113-168 s.

Which versions: the subscriber hands every received version to :class:`DueVersions` (its
background thread, so versions arrive while an eval runs), which keeps a copy of each one
that is a multiple of N (0 is ``eval.before``'s); the loop evaluates them oldest first.
Evaluated are exactly N, 2N, ... of the versions this stage received: a version published
before the stage joined the broadcast (a start later than version N, a restart) is
evaluated only when it has a weight snapshot (:meth:`EvalStage.catch_up`:
``trainer.weights_snapshot_every`` a divisor of N keeps one of each due version, the store
keeping the 3 newest). At most ``max_pending`` versions wait: when evaluating is slower
than N training steps, the oldest waiting one is dropped (a WARNING names it). The driver
waits, after the trainer's last step, for the eval row of the last due version
(:func:`wait_for_last_eval`) before it stops the stages; on stop the versions still
waiting are evaluated before the stage ends, within the controller's stop wait (60 s: an
eval longer than that, a large ``eval.size`` on CPU, is cut off there). During an eval the
stage calls ``should_stop`` after each engine call, so the controller does not take a long
eval for a stall (``stall_timeout_s`` is per engine call of ``eval.batch_size`` prompts).

Writes, per eval: the rows of :func:`relax.infra.offline.evaluate.eval_metrics` (component
``eval``, with the policy_version evaluated) to ``<run>.metrics``, flushed at once
(``relax monitor``, the dashboard's curve, ``metrics.jsonl``); the same values as
TensorBoard scalars in ``<run_dir>/tensorboard`` (the trainer's folder: one view) and,
with W&B on, to the W&B run ``<run>-eval`` (the trainer's W&B run takes history rows in
step order only, and an eval of version 2 may arrive after step 3); no Prometheus
endpoint. Delivery: at least once per version (a restarted stage may evaluate a version
again; readers keep the newest row of each version).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from relax.infra.offline.evaluate import eval_metrics, eval_rows, greedy_accuracy_of, source_keys
from relax.infra.recipe.specs import EvalStageConfig
from relax.schemas import metric_names as M
from relax.streams.client import BusConfig
from relax.streams.stage_contract import Declaration, Stage, Wiring, run_stage

log = logging.getLogger(__name__)

EVAL_COMPONENT = M.EVAL_COMPONENT
"""The ``component`` of every eval row in ``<run>.metrics``."""


class DueVersions:
    """The eval stage's weight target: a copy of each received policy_version that
    ``every`` evaluates (v > 0, v % every == 0, newer than the last one taken), at most
    ``max_pending`` kept (the oldest is dropped first; :attr:`dropped` lists them).

    ``update_weights`` is called by the subscriber's thread, :meth:`take` by the stage
    loop; both under one lock.
    """

    def __init__(self, every: int, max_pending: int = 2):
        if every < 1 or max_pending < 1:
            raise ValueError(f"every and max_pending must be >= 1, got {every}, {max_pending}")
        self.every, self.max_pending = every, max_pending
        self.taken = 0
        self.dropped: list[int] = []
        self._pending: dict[int, dict] = {}
        self._lock = threading.Lock()

    def due(self, policy_version: int) -> bool:
        """Whether ``policy_version`` is one to evaluate now (see the class docstring)."""
        return (policy_version > 0 and policy_version % self.every == 0
                and policy_version > self.taken)

    def update_weights(self, named: dict, policy_version: int) -> None:
        """Keep a copy of ``named`` (name -> tensor, views of the receive buffer) when
        ``policy_version`` is due; nothing otherwise."""
        if not self.due(policy_version):
            return
        copy = {k: t.detach().clone() for k, t in named.items()}
        with self._lock:
            self._pending[policy_version] = copy
            while len(self._pending) > self.max_pending:
                oldest = min(self._pending)
                del self._pending[oldest]
                self.dropped.append(oldest)
                log.warning("eval: policy_version %d dropped unevaluated: %d newer versions "
                            "wait (evaluating is slower than %d training steps)", oldest,
                            self.max_pending, self.every)

    def take(self) -> tuple[int, dict] | None:
        """``(policy_version, {name: tensor})`` of the oldest waiting version, or None."""
        with self._lock:
            waiting = [v for v in self._pending if v > self.taken]
            for v in [v for v in self._pending if v <= self.taken]:
                del self._pending[v]
            if not waiting:
                return None
            v = min(waiting)
            self.taken = v
            return v, self._pending.pop(v)


class EvalStage(Stage):
    """The eval stage: ``EvalStage(cfg, bus).run(should_stop)``, a stage on the stage
    contract (:mod:`relax.streams.stage_contract`) with no input topic: a turn waits for
    a version from the weight channel and evaluates the oldest due one. The model, the
    held-out rows and the reward pool are made with it; the subscriber when it is wired.

    Raises (on construction):
        relax.infra.offline.evaluate.TooFewEvalRows: the source has fewer than ``size`` prompts
            outside the training data.
        relax.consumers.reward.pool.RewardLoadError: the reward fails to load or warm up.
    """

    kind = "eval"
    config_type = EvalStageConfig

    def __init__(self, cfg: EvalStageConfig, bus: BusConfig):
        import torch

        from relax.consumers.reward.pool import RewardPool
        from relax.trainer.models import load_model, load_processor, load_tokenizer

        self.cfg = cfg
        t = cfg.training
        exclude = (source_keys(t.source, prompt_field=t.prompt_field, label_field=t.label_field,
                               media=t.media(), limit=t.limit) if t is not None else set())
        h = cfg.held_out
        self.rows = eval_rows(h.source, cfg.size, prompt_field=h.prompt_field,
                              label_field=h.label_field, exclude=exclude, media=h.media())
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model = load_model(cfg.model, device=device).eval()
        self.tokenizer = load_tokenizer(cfg.model)
        self.processor = load_processor(cfg.model)
        r = cfg.reward
        self.pool = RewardPool(r.fn, r.options, workers=1, batch_rows=cfg.batch_size,
                               timeout_s=r.timeout_s, memory_limit_bytes=r.memory_limit_bytes,
                               startup_timeout_s=r.startup_timeout_s)
        self.due = DueVersions(cfg.every, cfg.max_pending)
        self.bus = bus
        self.stats: list[int] = []  # the policy_versions evaluated
        self.subscriber = self.telemetry = self.producer = self.metrics = None

    def evaluate(self, policy_version: int, named: dict,
                 pulse: Callable[[], object] | None = None) -> dict[str, float]:
        """Install ``named`` into the model and evaluate it; the metric values
        (:func:`relax.infra.offline.evaluate.eval_metrics`). ``pulse``: called after each engine
        call (see :func:`relax.infra.offline.evaluate.greedy_accuracy_of`)."""
        from relax.streams.weights.install import install_weights

        install_weights(self.model, named, policy_version)
        c = self.cfg
        r = greedy_accuracy_of(self.model, self.tokenizer, self.rows, self.pool,
                               processor=self.processor, prompt_template=c.prompt_template,
                               max_new_tokens=c.max_new_tokens, batch_size=c.batch_size,
                               threshold=c.threshold, pulse=pulse)
        log.info("eval: policy_version %d: greedy held-out accuracy %d/%d = %.3f (%.1fs)",
                 policy_version, r.correct, r.n, r.accuracy, r.seconds)
        return eval_metrics(r)

    def catch_up(self) -> list[int]:
        """Hand :class:`DueVersions` the due versions published so far that have a weight
        snapshot (``trainer.weights_snapshot_every``; the newest ``max_pending`` of them, each
        checked against its announcement's checksum and manifest): the versions of a run
        that went on before this stage joined the broadcast. Returns them, oldest first.
        A snapshot that the store's retention deleted, or whose bytes do not match its
        announcement, is skipped with a WARNING."""
        from relax.streams.weights.announce import AnnouncementReader
        from relax.streams.weights.layout import checksum, manifest_from_rows, views
        from relax.streams.weights.store import read_snapshot, snapshot_exists

        reader = AnnouncementReader(self.bus, self.cfg.run)
        try:
            rows = reader.poll_backlog()
        finally:
            reader.close()
        snaps = {r["policy_version"]: r for r in rows if r["transport"] == "checkpoint"
                 and r["checkpoint_uri"] and self.due.due(r["policy_version"])}
        loaded = []
        for v in sorted(snaps)[-self.cfg.max_pending:]:
            uri = snaps[v]["checkpoint_uri"]
            if not snapshot_exists(uri):
                log.warning("eval: the snapshot of v%d (%s) was deleted by the store's "
                            "retention; not evaluated", v, uri)
                continue
            flat, manifest = read_snapshot(uri)
            if (checksum(flat) != snaps[v]["checksum"]
                    or manifest != manifest_from_rows(snaps[v]["manifest"])):
                log.warning("eval: the snapshot of v%d (%s) does not match its announcement; "
                            "not evaluated", v, uri)
                continue
            self.due.update_weights(views(flat, manifest), v)
            loaded.append(v)
        return loaded

    # -- the stage contract
    def declare(self) -> Declaration:
        """No input topic (fed by the weight channel); its rows go to ``<run>.metrics``."""
        c = self.cfg
        return Declaration(run=c.run, component=EVAL_COMPONENT,
                           producer_id=f"{c.run}-{c.member_id}", input=None)

    def build(self, w: Wiring) -> None:
        """The telemetry and the weight subscriber (its target: :class:`DueVersions`);
        then the due versions published before it joined (:meth:`catch_up`)."""
        from relax.streams.weights.subscriber import WeightSubscriber
        from relax.trainer.telemetry import Telemetry

        c = self.cfg
        self.producer, self.metrics = w.producer, w.metrics
        self.telemetry = Telemetry(c.run_dir, f"{c.run}-eval",
                                   c.telemetry.model_copy(update={"prometheus_port": None}))
        self.subscriber = WeightSubscriber(
            self.bus, c.run, member_id=c.member_id, target=self.due,
            rendezvous=c.weights_rendezvous, device=next(self.model.parameters()).device).start()
        caught = self.catch_up()
        if caught:
            log.info("eval: policy_versions %s published before this stage joined, from "
                     "their weight snapshots", caught)

    def turn(self) -> int:
        """Wait up to ``poll_timeout_s`` for a version, then evaluate the oldest due one
        (1) if any (0)."""
        return self._evaluate_next(self.cfg.poll_timeout_s)

    def _evaluate_next(self, wait_s: float) -> int:
        if wait_s:
            self.subscriber.poll(wait_s)  # raises if the subscriber's thread died
        item = self.due.take()
        if item is None:
            return 0
        values = self.evaluate(*item, pulse=self.should_stop)  # a long eval is no stall
        self.metrics.add_many(values, item[0])
        self.metrics.flush()
        self.producer.flush()
        self.telemetry.log_step(values, item[0])
        self.stats.append(item[0])
        return 1

    def finish(self) -> None:
        """Evaluate the versions still waiting (the run's last one)."""
        while self._evaluate_next(0):
            pass
        log.info("eval: evaluated %s; weights received %s, dropped %s", self.stats,
                 self.subscriber.stats.history, self.due.dropped)

    def close(self) -> None:
        """Close the subscriber, the reward pool and the telemetry."""
        if self.subscriber is not None:
            self.subscriber.close()
        self.pool.close()
        if self.telemetry is not None:
            self.telemetry.close()

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> list[int]:
        """Evaluate due versions until ``should_stop()``, then the ones still waiting
        (:func:`relax.streams.stage_contract.run_stage`); returns the policy_versions
        evaluated."""
        return run_stage(self, should_stop)


def last_due(steps: int, every: int) -> int:
    """The last policy_version of a run of ``steps`` steps that ``eval.every`` = ``every``
    evaluates (0: none; ``last_due(5, 2) == 4``)."""
    return steps // every * every


def wait_for_last_eval(follower, controller, policy_version: int, timeout_s: float) -> bool:
    """Wait until the eval row (``eval_accuracy``) of ``policy_version`` is among
    ``follower.rows`` (a :class:`relax.infra.control.run_watch.MetricsFollower`), while
    ``controller.check`` restarts a stage that died; True when it came, False after
    ``timeout_s`` seconds.

    Raises:
        relax.infra.control.controller.StageFailed: a stage used up its restarts meanwhile.
    """
    def seen() -> bool:
        return any(r["component"] == EVAL_COMPONENT and r["name"] == M.EVAL_ACCURACY
                   and r["policy_version"] == policy_version for r in follower.rows)

    deadline = time.monotonic() + timeout_s
    while not seen():
        if time.monotonic() > deadline:
            return False
        controller.check(0.2)
        follower.poll(0.5)
    return True


def publish_eval(bus: BusConfig, run: str, values: dict[str, float], policy_version: int) -> None:
    """Write one eval's metric rows (:func:`relax.infra.offline.evaluate.eval_metrics`) to
    ``<run>.metrics`` as component ``eval`` (the driver's ``eval.before``, version 0)."""
    from relax.streams.metrics import MetricsWriter
    from relax.streams.producer import BatchProducer

    producer = BatchProducer(bus, producer_id=f"{run}-eval-driver")
    try:
        writer = MetricsWriter(producer, run, EVAL_COMPONENT)
        writer.add_many(values, policy_version)
        writer.flush()
        producer.flush()
    finally:
        producer.close()


__all__ = ["EVAL_COMPONENT", "DueVersions", "EvalStage", "last_due",
           "publish_eval", "wait_for_last_eval"]

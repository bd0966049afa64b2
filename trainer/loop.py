"""The trainer loop: consume a batch, step, publish the weights, checkpoint.

    restore newest checkpoint (or start at policy_version 0)
    publish the current weights (subscribers start from them)
    while policy_version < steps:
        batch  = source.next_batch(policy_version)      # admitted by staleness
        (GAE: the critic's values, advantages and update; relax.trainer.critic)
        stats  = backend.train_step(micro_batches(batch))
        policy_version += 1
        checkpoint (every K steps), then commit the input offsets
        publish weights as policy_version               # broadcast overlaps the next step
        metrics -> <run>.metrics, TensorBoard, Prometheus

Options are fixed when the components are built (``TrainerStage.__init__`` and
``build``); the loop itself does not branch on them.
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.streams.client import BusConfig
from relax.streams.metrics import MetricsWriter
from relax.streams.progress import PROGRESS_KEY, progress_row
from relax.streams.stage import memory_metrics
from relax.streams.stage_contract import (Declaration, Hooks, Input, OutTopic, Stage, Wiring,
                                          run_stage)
from relax.trainer import checkpoint
from relax.trainer.backends import build_backend
from relax.trainer.batching import micro_batches, split_groups, teacher_kl
from relax.trainer.config import TrainerStageConfig
from relax.trainer.distributed import node_address
from relax.trainer.ledger import Ledger
from relax.trainer.source import Batch, SampleSource
from relax.trainer.step_batch import step_batch
from relax.trainer.telemetry import Telemetry

log = logging.getLogger(__name__)


def batch_metrics(batch: Batch, accuracy_reward: str | None, threshold: float) -> dict[str, float]:
    """Reward, accuracy and staleness statistics of a step.

    ``reward_mean`` / ``accuracy`` cover every sample the step decided on that was scored:
    the trained rows and those filtered upstream (zero-variance groups), i.e. what the
    policy produced; ``reward_mean_trained`` covers the trained rows only."""
    def correct(comps) -> float:
        comps = dict(comps)
        name = accuracy_reward or (next(iter(comps)) if comps else None)
        return float(comps.get(name, 0.0) > threshold) if name else 0.0

    trained_r = np.concatenate([g.column("reward").to_numpy() for g in batch.groups])
    trained_c = [correct(c) for g in batch.groups
                 for c in g.column("reward_components").to_pylist()]
    all_r = np.concatenate([trained_r, np.asarray([r for r, _ in batch.filtered], np.float64)])
    all_c = trained_c + [correct(c) for _, c in batch.filtered]
    st = np.asarray(batch.staleness, np.float64)
    out = {M.REWARD_MEAN: float(all_r.mean()), M.ACCURACY: float(np.mean(all_c)),
           M.REWARD_MEAN_TRAINED: float(trained_r.mean()),
           M.STALENESS_MEAN: float(st.mean()), M.STALENESS_MAX: float(st.max()),
           M.SAMPLES_TRAINED: float(batch.rows), M.DATA_WAIT_S: batch.wait_s,
           M.SAMPLES_DROPPED_STALE: float(batch.dropped.get("stale", 0)),
           M.SAMPLES_DROPPED_FILTERED: float(batch.dropped.get("filtered", 0)),
           M.SAMPLES_ERROR: float(batch.dropped.get("error", 0))}
    for k, n in Counter(batch.staleness).items():
        out[M.staleness_hist_name(k)] = float(n)
    return out


def cpu_usage(before, after) -> dict[str, float]:
    """This process's user and kernel CPU seconds and minor page faults between two
    ``resource.getrusage`` readings (all its threads)."""
    return {M.TRAIN_CPU_USER_S: after.ru_utime - before.ru_utime,
            M.TRAIN_CPU_SYS_S: after.ru_stime - before.ru_stime,
            M.TRAIN_PAGE_FAULTS: float(after.ru_minflt - before.ru_minflt)}


def advantage_metrics(groups: list) -> dict[str, float]:
    """Mean and sample std (``n - 1``) over the batch's rows of each row's advantage (its
    value on the first response token; outcome estimators give one value per row)."""
    first = np.asarray([a[0] if a else 0.0 for g in groups
                        for a in g.column("advantages").to_pylist()], np.float64)
    std = float(first.std(ddof=1)) if len(first) > 1 else 0.0
    return {M.ADVANTAGE_MEAN: float(first.mean()) if len(first) else 0.0, M.ADVANTAGE_STD: std}


class TrainerStage(Stage):
    """The trainer as a process: ``TrainerStage(cfg, bus).run(should_stop)``, a stage on
    the stage contract (:mod:`relax.streams.stage_contract`): its input is
    ``<run>.train_samples`` (read ahead by :class:`SampleSource` in a thread, on the
    contract's consumer), its outputs the progress and the metrics; a turn is one
    optimizer step. It commits its input offsets with each checkpoint, not at the end
    (:attr:`commit_at_end`), and writes its own ``busy_frac`` per step.

    The back end, the ranks, the critic and the newest checkpoint are loaded when it is
    made (a colocated stage shares the back end's model before the run); the bus
    clients, the weight publisher and the input thread when it is wired
    (:meth:`build`), which publishes the starting weights.
    """

    kind = "trainer"
    config_type = TrainerStageConfig
    commit_at_end = False
    busy_window = False

    def __init__(self, cfg: TrainerStageConfig, bus: BusConfig):
        import torch

        t = cfg.trainer
        if t.num_threads:
            torch.set_num_threads(t.num_threads)
        self.cfg, self.bus = cfg, bus
        self.run_dir = Path(cfg.run_dir)
        self.ranks = None
        if cfg.processes > 1:  # before the back end: DDP is built on the process group
            from relax.trainer.ranks import Ranks

            self.ranks = Ranks(cfg.processes, t, self.run_dir / "logs",
                               torch_threads=torch.get_num_threads(), hosts=cfg.rank_hosts,
                               num_cpus=cfg.rank_num_cpus)
        self.backend = build_backend(t)
        self.critic = None
        if t.critic is not None:  # PPO's critic, on rank 0 (relax.trainer.critic)
            from relax.trainer.critic import Critic

            self.critic = Critic(t)
        self.ledger = Ledger()
        self._state = checkpoint.TrainerState(policy_version=0)
        ckpt = checkpoint.latest(self.run_dir, t.checkpoint_store)
        if ckpt is not None:
            self._state, self.ledger = checkpoint.load(ckpt, self.backend, self.critic)
            log.info("resumed from %s at policy_version %d", ckpt, self._state.policy_version)
        if self.ranks is not None:
            self.backend.broadcast_state()
        self.version = self._state.policy_version
        self.counters = Counter(self._state.counters)
        # progress (the rollout stage's credit, on <run>.progress; a copy on the metrics
        # for people) is written from the input thread too: its own writer, under a lock
        self._progress_lock = threading.Lock()
        self._progress_topic = topics.run_topic(cfg.run, topics.PROGRESS)
        self.producer = self.metrics = self._progress_metrics = None
        self.publisher = self.source = None
        self.telemetry = Telemetry(self.run_dir, cfg.run, cfg.telemetry)
        if self.telemetry.prometheus_port is not None:
            log.info("Prometheus metrics on http://%s:%d/metrics (bearer token: $RELAX_API_TOKEN "
                     "or %s)", cfg.telemetry.prometheus_host, self.telemetry.prometheus_port,
                     self.run_dir / "api_token")

    # -- the stage contract
    def declare(self) -> Declaration:
        """``<run>.train_samples`` in the consumer group ``<run>.trainer`` (its partitions
        sought to the checkpoint's offsets when first assigned); ``<run>.progress``."""
        run = self.cfg.run
        return Declaration(
            run=run, component="trainer", producer_id=f"{run}-trainer",
            input=Input((topics.run_topic(run, topics.TRAIN_SAMPLES),),
                        topics.group(run, "trainer"), "trainer", on_assign=self._on_assign),
            outputs=(OutTopic(self._progress_topic, 1),))

    def _on_assign(self, tps) -> None:
        self.source.seek_assigned(tps)

    def build(self, w: Wiring) -> None:
        """The metrics writers, the weight publisher and the input thread on the wiring's
        producer and consumer; then publish the starting weights and the progress."""
        from relax.streams.weights.publisher import WeightPublisher
        from relax.streams.weights.shm_folders import SHM_ROOT

        cfg, t = self.cfg, self.cfg.trainer
        self.producer, self.metrics = w.producer, w.metrics
        if self._state.metrics:  # the resumed step's row, in case it never reached the bus
            self.metrics.add_many(self._state.metrics, self._state.policy_version)
            self.metrics.flush()
        self._progress_metrics = MetricsWriter(w.producer, cfg.run, "trainer")
        sends = cfg.publish_weights
        self.publisher = WeightPublisher(
            w.bus, cfg.run, host=cfg.weights_host or node_address(), port=cfg.weights_port,
            checkpoint_dir=(t.weights_store or self.run_dir / "weights") if sends else None,
            checkpoint_every=t.weights_snapshot_every,
            bucket_bytes=t.publish_bucket_bytes, producer=w.producer,
            shm_root=SHM_ROOT if t.weights_shm and sends else None)
        self.source = SampleSource(w.bus, cfg.run, self.ledger, batch_groups=t.batch_groups,
                                   max_staleness=t.max_staleness, offsets=self._state.offsets,
                                   on_drop=self._progress, start_version=self.version,
                                   consumer=w.consumer, start=False)
        self.source.start()  # its first poll calls _on_assign, which reads self.source
        self._publish()
        self._progress()

    def turn(self) -> int:
        """One optimizer step (1); 0 when stopped while waiting for data, or at
        ``trainer.steps`` already (a resumed run that had finished)."""
        if self.version >= self.cfg.trainer.steps:
            return 0
        return 0 if self.step(self.should_stop) is None else 1

    def hooks(self) -> Hooks:
        """The run ends at ``trainer.steps``."""
        return Hooks(done=lambda: self.version >= self.cfg.trainer.steps)

    def finish(self) -> None:
        """Stop the input thread; after the last step, save the final model to
        ``<run_dir>/final_model`` (and to ``<trainer.checkpoint_store>/final_model``),
        PPO's critic to ``<run_dir>/critic`` (and the store's ``critic``), and write
        ``done``."""
        self.source.close()
        if self.version < self.cfg.trainer.steps:
            return
        self.publisher.wait()
        final = self.run_dir / checkpoint.FINAL_MODEL
        self.backend.save_model(final)
        if self.critic is not None:
            self.critic.save(self.run_dir / checkpoint.CRITIC_DIR)
        if self.cfg.trainer.checkpoint_store is not None:
            checkpoint.upload_folder(final, self.cfg.trainer.checkpoint_store,
                                     checkpoint.FINAL_MODEL)
            if self.critic is not None:
                checkpoint.upload_folder(self.run_dir / checkpoint.CRITIC_DIR,
                                         self.cfg.trainer.checkpoint_store,
                                         checkpoint.CRITIC_DIR)
        self.metrics.add("done", 1.0, self.version)

    def run(self, should_stop: Callable[[], bool]) -> None:
        """Publish the starting weights, then step until ``steps`` or ``should_stop()``
        (:func:`relax.streams.stage_contract.run_stage`; :meth:`finish` at a normal end)."""
        run_stage(self, should_stop)

    # -- progress for the rollout stage's credit
    def _progress(self, consumed_delta: int = 0) -> None:
        """Add to the groups consumed and write consumed/needed (any thread)."""
        t = self.cfg.trainer
        with self._progress_lock:
            self.counters["groups_consumed"] += consumed_delta
            consumed = self.counters["groups_consumed"]
            needed = max(0, t.steps - self.version) * t.batch_groups
            self.producer.send(self._progress_topic, progress_row(
                consumed, needed, self.version), key=PROGRESS_KEY)
            w = self._progress_metrics
            w.add(M.GROUPS_CONSUMED, consumed, self.version)
            w.add(M.GROUPS_NEEDED, needed, self.version)
            w.flush()
            self.producer.flush()  # this thread's sends (BatchProducer tracks each thread's)

    def _publish(self) -> None:
        """Publish the weights at :attr:`version` (or announce the version only:
        ``publish_weights`` False)."""
        if self.cfg.publish_weights:
            self.publisher.publish(self.backend.named_tensors(), self.version)
        else:
            self.publisher.announce_version(self.version)

    def _save_due(self, version: int) -> bool:
        """A checkpoint is saved after the step that reaches ``version``: every
        ``checkpoint_every`` versions and at the last step."""
        t = self.cfg.trainer
        return bool(t.checkpoint_every and version % t.checkpoint_every == 0) or version == t.steps

    def _save(self, metrics: dict[str, float]) -> None:
        with self.source.locked(), self._progress_lock:  # the input thread writes the ledger
            state = checkpoint.TrainerState(self.version, self.source.positions(),
                                            dict(self.counters), dict(metrics))
            checkpoint.save(self.run_dir, self.backend, state, self.ledger,
                            keep=self.cfg.trainer.keep_checkpoints,
                            store=self.cfg.trainer.checkpoint_store, critic=self.critic)
            self.source.commit()

    def _timed(self, out: dict[str, float], batch, t0: float) -> dict[str, float]:
        """``out`` with the step's timings so far (seconds since ``t0``)."""
        out[M.STEP_S] = time.perf_counter() - t0
        out[M.SAMPLES_PER_S] = batch.rows / out[M.STEP_S]
        out[M.BUSY_FRAC] = max(0.0, 1.0 - batch.wait_s / out[M.STEP_S])
        return out

    def step(self, should_stop: Callable[[], bool]) -> dict[str, float] | None:
        """One optimizer step; None when stopped while waiting for data."""
        t = self.cfg.trainer
        t0 = time.perf_counter()
        batch = self.source.next_batch(self.version, should_stop)
        if batch is None:
            return None
        prepared = step_batch(batch.groups, t, self.critic)
        adv_stats = advantage_metrics(prepared.advantaged)
        groups, counts = prepared.trained, prepared.counts
        save = self._save_due(self.version + 1)
        if self.ranks is not None:
            n = self.ranks.world_size  # megatron: every TP rank takes the whole batch
            shares = [groups] * n if t.backend == "megatron" else split_groups(groups, n)
            groups, counts = self.ranks.scatter(shares, counts, save)
        before = resource.getrusage(resource.RUSAGE_SELF)
        stats = self.backend.train_step(micro_batches(groups, t.max_tokens_per_microbatch),
                                        counts=counts, gather_optimizer=save)
        stats.update(cpu_usage(before, resource.getrusage(resource.RUSAGE_SELF)))
        stats.update(memory_metrics())
        self.source.trained(batch, self.version)
        out = {**stats, **batch_metrics(batch, t.accuracy_reward, t.accuracy_threshold),
               **adv_stats, **prepared.metrics}
        kl = teacher_kl(batch.groups)
        if kl is not None:
            out[M.TEACHER_KL] = kl
        self.version += 1
        with self._progress_lock:
            self.counters["groups_consumed"] += len(batch.groups)
        if save:
            tc = time.perf_counter()
            self._save(self._timed(out, batch, t0))
            out[M.CHECKPOINT_S] = time.perf_counter() - tc
        tp = time.perf_counter()
        self._publish()
        out[M.PUBLISH_S] = time.perf_counter() - tp
        if len(self.publisher.history) > 1:  # publish waited for the previous one's end
            sent = self.publisher.history[-2]
            out[M.WEIGHTS_SEND_S] = sent.publish_s
            out[M.WEIGHTS_LOCAL] = len(sent.local)
            out[M.WEIGHTS_BROADCAST] = len(sent.members) - len(sent.local)
        self.metrics.add_many(self._timed(out, batch, t0), self.version)
        self.metrics.flush()
        self._progress()
        self.producer.flush()
        self.telemetry.log_step(out, self.version)
        return out

    def close(self) -> None:
        """Stop the other data-parallel ranks, the publisher and the input thread, close
        the telemetry (the contract closes the consumer and the producer, with no offset
        commit). Also for a stage made and never run (a colocated stage's check)."""
        if self.ranks is not None:
            self.ranks.close()
        if self.publisher is not None:
            self.publisher.close()
        if self.source is not None:
            self.source.close()
        self.telemetry.close()

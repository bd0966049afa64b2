"""Follow a running run until its trainer's last step: print a line per optimizer step,
restart stalled stages, and fail with a report when a stage fails past its restarts,
no step comes for ``step_timeout_s``, the broker stops answering or loses its state;
fail with one line when a counted reward keeps the run from training (every row of its
last groups failed, or it scored none for a while: :mod:`relax.infra.control.stuck`).

Used by :func:`relax.infra.control.launch.train` between starting the stages and finishing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from relax.infra.broker.local import BROKER_DIR
from relax.infra.control.controller import Controller, StageFailed
from relax.infra.control.stuck import ProgressCheck, Stuck
from relax.infra.control.watch import broker_state_lost
from relax.infra.observe.report import stall_report, step_rows
from relax.infra.recipe.recipe import Recipe
from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.streams.client import BusConfig
from relax.streams.lag import LagProbe
from relax.streams.read import read_reward_errors

WATCH_EVERY_S = 5.0
"""Seconds between the controller's stall checks (heartbeats, consumer-group offsets)
and the broker check."""
BROKER_GONE_S = 120.0
"""A run whose broker does not answer for this long fails (seconds)."""
BROKER_LOST_STOP_S = 5.0
"""Seconds the stages of a run whose broker is gone or lost its state get to stop before
they are killed: their producers retry against a broker that no longer knows them, and
there is no offset left to commit (a clean stop waits 60 s)."""
STUCK_STOP_S = 15.0
"""Seconds the stages of a run that cannot train (:mod:`relax.infra.control.stuck`) get to stop
before they are killed: the reward that keeps it from training may be inside one poll
for minutes (a call of up to its ``timeout_s``, then each row alone as long), where a
clean stop waits 60 s; the others wait for data and stop at once."""
METRICS_FETCH_WAIT_MS = 1000
"""The driver's metrics reader's longest empty fetch (``fetch_max_wait_ms``). It only
prints steps and sees the trainer's ``done``, where the stages' 200 ms default would
cost five fetch round trips a second in the driver and the broker for the whole run."""

log = logging.getLogger(__name__)


class RunFailed(RuntimeError):
    """A run that cannot go on; the message says why and reports every stage."""


class RunTimeout(RunFailed, TimeoutError):
    """A run that did not finish within the caller's ``timeout_s``."""


class MetricsFollower:
    """Reads ``<run>.metrics`` from the start, incrementally (group-less); ``sink`` gets
    each batch of new rows (the run's :class:`~relax.trainer.telemetry.StageBoard`)."""

    def __init__(self, bus: BusConfig, run: str,
                 sink: Callable[[list[dict]], object] | None = None):
        from relax.streams.read import TopicReader

        self.bus, self.sink = bus, sink
        self.topic = topics.run_topic(run, topics.METRICS)
        self.reader = TopicReader(bus, "train", fetch_wait_ms=METRICS_FETCH_WAIT_MS)
        self.reader.follow(self.topic, 1)
        self.rows: list[dict] = []
        self.next_offset = 0

    def poll(self, timeout_s: float = 1.0) -> list[dict]:
        """New metric rows since the last call (records that are not a metrics batch are
        logged and skipped: not ours to stop on)."""
        from relax.streams.read import decoded_rows

        msgs = self.reader.poll(timeout_s)
        if msgs:
            self.next_offset = max(self.next_offset, max(m.offset for m in msgs) + 1)
        new = [r for m in msgs for r in decoded_rows(m, "metrics", log)]
        self.rows.extend(new)
        if new and self.sink is not None:
            self.sink(new)
        return new

    def read_to_end(self, timeout_s: float = 30.0) -> bool:
        """Poll until every record written before the call is read (the topic's high
        watermark then); False when that took over ``timeout_s`` seconds or the end
        could not be learnt (a warning says how far it got). After a broker node is
        lost, the new leader of the topic may answer only seconds later: one short poll
        at the end of a run missed the last steps (CI, 3-node Kafka)."""
        from kafka.errors import KafkaError

        from relax.streams.lag import high_watermarks

        deadline = time.monotonic() + timeout_s
        try:
            end = high_watermarks(self.bus, [self.topic], timeout_s).get((self.topic, 0), 0)
        except (KafkaError, TimeoutError) as e:
            log.warning("%s: its end offset could not be read (%s); %d records read",
                        self.topic, e, self.next_offset)
            return False
        while self.next_offset < end:
            if time.monotonic() > deadline:
                log.warning("%s: read to offset %d of %d in %.0fs", self.topic,
                            self.next_offset, end, timeout_s)
                return False
            self.poll(0.5)
        return True

    def close(self) -> None:
        self.reader.close()


def step_line(s: dict, total: int) -> str:
    """One printed line per optimizer step."""
    wait = s.get(M.DATA_WAIT_S, 0.0) / max(s.get(M.STEP_S, 1e-9), 1e-9)
    return (f"step {int(s['step']):>3}/{total} policy_version={int(s['step'])} "
            f"reward={s.get(M.REWARD_MEAN, float('nan')):.3f} "
            f"acc={s.get(M.ACCURACY, float('nan')):.3f} "
            f"staleness={s.get(M.STALENESS_MEAN, 0):.2f}/{int(s.get(M.STALENESS_MAX, 0))} "
            f"samples/s={s.get(M.SAMPLES_PER_S, 0):.2f} wait={100 * wait:.0f}% "
            f"step_s={s.get(M.STEP_S, 0):.1f} train_s={s.get(M.TRAIN_S, 0):.1f} "
            f"publish_s={s.get(M.PUBLISH_S, 0):.2f}")


class RunWatch:
    """The watch loop of one run (module docstring).

    Args:
        recipe, bus, run_dir: the run.
        controller: its started stages.
        follower: its metrics.
        say: where progress lines go.
        on_step: called with each step's metrics and the run folder.
        broker_pid: the process of the run's own local broker (None: a broker the run
            does not own): when it is gone the run ends at the next check, without
            waiting :data:`BROKER_GONE_S` for an answer that cannot come.
    """

    def __init__(self, recipe: Recipe, bus: BusConfig, run_dir: Path, controller: Controller,
                 follower: MetricsFollower, say: Callable[[str], None],
                 on_step: Callable[[dict, Path], None] | None = None,
                 broker_pid: int | None = None):
        self.recipe, self.bus, self.run_dir = recipe, bus, run_dir
        self.broker_pid = broker_pid
        self.controller, self.follower, self.say, self.on_step = controller, follower, say, on_step
        self.printed: set[int] = set()
        self.last_step = self.watched = time.monotonic()
        self.seen_records: int | None = None
        self.unreachable_since: float | None = None
        self.scaler = None  # a relax.infra.control.scaling.RolloutScaler when the API is on
        self.snapshot: dict = {"status": {}, "engines": []}  # what the API reads
        self._snapshot_at = 0.0
        self.probe = LagProbe(bus)  # the broker and stall checks' one admin client
        env = recipe.environment_reward()  # written by the rollout stage: no reward stage
        self.progress = ProgressCheck([r for r in recipe.advantage.rewards if r != env],
                                      recipe.rollout.group_size, recipe.stuck,
                                      int(time.time() * 1000))

    def failed(self, cls: type[RunFailed], why: str) -> RunFailed:
        """``cls`` with ``why``, the step reached, every stage and the latest metrics."""
        self.follower.poll(0.5)
        return cls(f"run {self.recipe.run} {why}, at step {len(self.printed)} of "
                   f"{self.recipe.trainer.steps}.\nstages:\n{self.controller.describe()}\n"
                   f"latest metrics:\n"
                   + (stall_report(self.follower.rows, int(time.time() * 1000))
                      or "(none written yet)"))

    def until_done(self, stopping: Callable[[], bool], deadline: float | None = None) -> None:
        """Watch until the trainer is done or ``stopping()``. When the trainer is done, the
        metrics written before are read to their end first, so that every step is printed
        and gets its ``on_step`` (the trainer's process may end before the last steps'
        records reach this reader: a test waiting at step 2 of 3 never ran).

        Raises:
            RunTimeout: ``time.time()`` passed ``deadline``.
            RunFailed: a stage failed past its restarts, no step for ``step_timeout_s``,
                the broker is gone or lost its state, or a counted reward keeps the run
                from training (``recipe.stuck``; the message is one line naming it).
        """
        try:
            self._until_done(stopping, deadline)
        finally:
            self.probe.close()

    def _until_done(self, stopping: Callable[[], bool], deadline: float | None) -> None:
        step_timeout = self.recipe.step_timeout_s
        done = False
        while not done and not stopping():
            if deadline is not None and time.time() > deadline:
                raise self.failed(RunTimeout, "did not finish in time")
            if step_timeout and time.monotonic() - self.last_step > step_timeout:
                raise self.failed(RunFailed, f"made no optimizer step for {step_timeout:.0f}s")
            try:
                finished = self.controller.check(0.2)
                if time.monotonic() - self.watched > WATCH_EVERY_S:
                    self.watched = time.monotonic()
                    if not self._broker_answers():
                        continue
                    for line in self.controller.watch(self.probe):
                        self.say(f"restarted {line}")
            except StageFailed as e:
                raise self.failed(RunFailed, f"failed: {e}") from None
            rows = self.follower.poll(0.5)
            self._print_steps()
            self._check_progress(rows)
            self.control()
            done = "trainer" in finished or any(  # not the done of a part before --resume
                r["component"] == "trainer" and r["name"] == "done"
                and (r["policy_version"] or 0) >= self.recipe.trainer.steps for r in rows)
        if done:
            self.follower.read_to_end()
            self._print_steps()

    def _check_progress(self, rows: list[dict]) -> None:
        """Fold the new metrics ``rows`` into the progress check.

        Raises:
            RunFailed: one line: the counted reward that keeps the run from training, the
                share of its rows that failed and the first failed row's error.
        """
        self.progress.add(rows)
        stuck = self.progress.stuck(int(time.time() * 1000))
        if stuck is None:
            return
        topic = topics.run_topic(self.recipe.run, topics.REWARDS)
        first = first_reward_error(self.bus, topic, stuck) if stuck.rows else None
        timeout_s = next((r.timeout_s for r in self.recipe.rewards if r.name == stuck.reward), None)
        err = RunFailed(f"run {self.recipe.run}: {stuck.line(first, timeout_s)} (at step "
                        f"{len(self.printed)} of {self.recipe.trainer.steps}; `relax errors "
                        f"{topic}` lists the failed rows)")
        self.controller.stop(timeout_s=STUCK_STOP_S)
        raise err

    def control(self) -> None:
        """Move the scaling operation on and refresh the API's snapshot: at every turn
        while an operation runs, else every 2 s."""
        from relax.infra.control.scaling import DONE

        sc = self.scaler
        if sc is None:
            return
        busy = sc.current is not None and sc.current.state not in DONE
        if not busy and time.monotonic() - self._snapshot_at < 2.0:
            return
        self._snapshot_at = time.monotonic()
        beats = self.controller.status()
        version = next((r["policy_version"] for r in reversed(self.follower.rows)
                        if r["component"] == "trainer" and r["policy_version"] is not None), None)
        sc.advance(beats, self.follower.rows, version)
        stages = {n: {"pid": r.pid, "node": r.node, "restarts": r.restarts,
                      "finished": r.finished} for n, r in self.controller.stages.items()}
        self.snapshot = {
            "status": {"run": self.recipe.run, "policy_version": version,
                       "steps": self.recipe.trainer.steps, "rollout_instances": sc.instances,
                       "operation": sc.current.public() if sc.current else None,
                       "stages": {n: {**st, "loop_age_s": (beats.get(n) or {}).get("loop_age_s")}
                                  for n, st in stages.items()}},
            "engines": sc.engines(beats, stages)}

    def _print_steps(self) -> None:
        for s in step_rows(self.follower.rows):
            if s["step"] not in self.printed:
                self.printed.add(s["step"])
                self.last_step = time.monotonic()
                self.say(step_line(s, self.recipe.trainer.steps))
                if self.on_step is not None:
                    self.on_step(s, self.run_dir)

    def _broker_answers(self) -> bool:
        """Check the broker: False while it does not answer (for under BROKER_GONE_S).

        Raises:
            RunFailed: it has not answered for BROKER_GONE_S, or lost its topics.
        """
        from kafka.errors import KafkaError

        from relax.infra.broker.handle import pid_alive

        bootstrap = self.bus.bootstrap_servers
        if self.broker_pid is not None and not pid_alive(self.broker_pid):
            err = self.failed(RunFailed, broker_died_text(self.recipe, self.run_dir, bootstrap,
                                                          self.broker_pid))
            self.controller.stop(timeout_s=BROKER_LOST_STOP_S)
            raise err
        try:
            topic = topics.run_topic(self.recipe.run, topics.METRICS)
            records = _metrics_records(self.probe, topic)
        except (KafkaError, TimeoutError) as e:
            self.unreachable_since = self.unreachable_since or time.monotonic()
            if time.monotonic() - self.unreachable_since > BROKER_GONE_S:
                err = self.failed(RunFailed, f"lost its broker: {bootstrap} has not "
                                  f"answered for {BROKER_GONE_S:.0f}s ({e})")
                self.controller.stop(timeout_s=BROKER_LOST_STOP_S)
                raise err from None
            return False
        self.unreachable_since = None
        if broker_state_lost(self.seen_records, records):
            err = self.failed(RunFailed, broker_lost_text(
                self.recipe, self.run_dir, bootstrap, self.seen_records, records))
            self.controller.stop(timeout_s=BROKER_LOST_STOP_S)
            raise err
        self.seen_records = max(self.seen_records or 0, records or 0)
        return True


def first_reward_error(bus: BusConfig, topic: str, stuck: Stuck, tries: int = 3) -> str | None:
    """The error of the first failed row of ``stuck.reward`` on ``topic`` (a
    ``<run>.rewards``) written since ``stuck.since_ms``, else of its newest failed row;
    None when there is none after ``tries`` reads a second apart (a poll's counts are
    queued before its rows, so the watcher may see them first). Reads the whole topic."""
    for i in range(tries):
        rows = [r for r in read_reward_errors(bus, topic)[0] if r["reward_name"] == stuck.reward]
        if rows:
            since = [r for r in rows if r["ts"].timestamp() * 1000 >= stuck.since_ms]
            return (min(since, key=lambda r: r["ts"]) if since
                    else max(rows, key=lambda r: r["ts"]))["error"]
        if i + 1 < tries:
            time.sleep(1.0)
    return None


def _metrics_records(probe: LagProbe, topic: str) -> int | None:
    """Records in the run's metrics topic, None when the topic does not exist.

    Raises:
        kafka.errors.KafkaError, TimeoutError: the broker does not answer.
    """
    if topic not in probe.topic_partitions([topic]):
        return None
    return probe.high_watermarks([topic], timeout_s=5.0).get((topic, 0), 0)


def broker_died_text(recipe: Recipe, run_dir: Path, bootstrap: str, pid: int) -> str:
    """Why the run stops after its own local broker's process died, and how to go on:
    its topics and offsets are on disk in the run folder, so ``relax train --resume``
    starts the broker again from them and the run goes on."""
    return (f"lost its broker: the run's local broker at {bootstrap} (pid {pid}) is gone; "
            f"its topics and every stage's committed offsets are kept in "
            f"{run_dir / BROKER_DIR}, so nothing on the bus is lost: go on with "
            f"relax train --resume {run_dir} (it starts the broker again from there)")


def broker_lost_text(recipe: Recipe, run_dir: Path, bootstrap: str, seen: int,
                      now: int | None) -> str:
    """Why the run stops after its broker lost the topics, what was lost, how to go on
    (:func:`how_to_go_on`)."""
    now_txt = "is gone" if now is None else f"holds {now} records"
    return (f"lost its broker's state: {bootstrap} was restarted (the metrics topic had "
            f"{seen} records and now {now_txt}: it came back without its data). Lost: "
            f"every prompt, rollout, reward and train sample on the bus, the aggregator's "
            f"partial groups and the consumer offsets. "
            f"{how_to_go_on(recipe, run_dir)}")


def how_to_go_on(recipe: Recipe, run_dir: Path) -> str:
    """What a run whose topics are gone keeps and the commands to go on from it; the
    newest checkpoint gets the tokenizer so it loads as a model."""
    from relax.trainer import checkpoint

    ckpt = checkpoint.latest(run_dir, recipe.trainer.checkpoint_store)
    if ckpt is not None and recipe.trainer.lora is not None:  # adapter-only checkpoints
        from relax.trainer.lora import ADAPTER_DIR

        return (f"Kept: the trainer's checkpoint {ckpt} (policy_version "
                f"{int(ckpt.name.split('_')[-1])}): a LoRA adapter over {recipe.model} in "
                f"{ckpt / ADAPTER_DIR} (loads with peft.PeftModel.from_pretrained). To go "
                f"on, start the run again, or replay an archive made before: relax replay "
                f"ARCHIVE --run NEW.")
    if ckpt is not None:
        save_tokenizer(recipe.model, ckpt)
        kept = (f"Kept: the trainer's checkpoint {ckpt} (policy_version "
                f"{int(ckpt.name.split('_')[-1])}, loads as a model). To go on, either "
                f"start a fresh run from those weights: relax train "
                f"{run_dir / 'recipe.yaml'} model={ckpt} run=NEW (prompts are published "
                f"again), or replay an archive made before: relax replay ARCHIVE --run NEW.")
    else:
        kept = "No trainer checkpoint was written yet: start the run again."
    return kept


def save_tokenizer(model: str, folder: Path) -> None:
    """Save ``model``'s tokenizer next to saved weights in ``folder``, and its processor
    (feature extractor or image processor, chat template) for a multimodal model, so the
    folder loads like the model did (an eval of a run's ``final_model`` needs both)."""
    from relax.trainer.models import load_processor, load_tokenizer

    if not (folder / "tokenizer_config.json").exists():
        load_tokenizer(model).save_pretrained(folder)
    processor = load_processor(model)
    if processor is not None and not (folder / "processor_config.json").exists():
        processor.save_pretrained(folder)

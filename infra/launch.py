"""``relax train``: wire a run together and drive it to its end.

1. a broker (the recipe's ``bootstrap_servers``, or a local Tansu started here);
2. the run's topics, created with their partition counts;
3. the training prompts published into ``prompts.<dataset>`` if that topic is empty;
4. greedy held-out accuracy of the initial model (``eval.before``);
5. every stage as its own process under the :class:`~relax.infra.controller.Controller`
   (restarted if it dies), while this process follows ``<run>.metrics`` and prints a
   line per optimizer step;
6. when the trainer has made its last step: stop everything, evaluate the final
   model, write the run folder (metrics.jsonl, curves.png, summary.json) and print
   ``steps=S sampled=N trained=T stale=A filtered=B errors=E``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import yaml

from relax.infra.broker import LocalBroker
from relax.infra.controller import Controller, StageFailed
from relax.infra.preflight import preflight
from relax.infra.recipe import Recipe
from relax.infra.stages import stage_specs
from relax.infra.watch import broker_state_lost
from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.streams.client import BusConfig, ensure_topics

log = logging.getLogger(__name__)

WATCH_EVERY_S = 5.0
"""Seconds between the controller's stall checks (heartbeats, consumer-group offsets)
and the broker check."""
BROKER_GONE_S = 120.0
"""A run whose broker does not answer for this long fails (seconds)."""


class RunFailed(RuntimeError):
    """A run that cannot finish: the message says which stage and why, then the latest
    metrics of every stage (``relax.infra.report.stall_report``)."""


class RunTimeout(RunFailed, TimeoutError):
    """``relax train --timeout-s`` ran out (the same report as :class:`RunFailed`)."""


def run_topics(recipe: Recipe) -> dict[str, int]:
    """Every topic of the run with its partition count (errors topics: 1)."""
    p = recipe.partitions
    parts = {topics.run_topic(recipe.run, n): p for n in
             (topics.ROLLOUTS, topics.REWARDS, topics.REF_LOGPROBS, topics.TRAIN_SAMPLES)}
    parts[topics.run_topic(recipe.run, topics.WEIGHTS)] = 1
    parts[topics.run_topic(recipe.run, topics.METRICS)] = 1
    parts[topics.changelog_topic(recipe.run)] = p
    parts[topics.rollout_state_topic(recipe.run)] = 1
    for t in list(parts):
        parts[topics.errors_topic(t)] = 1
    prompts = topics.prompts_topic(recipe.data.dataset)
    parts[topics.errors_topic(prompts)] = 1
    return parts


class MetricsFollower:
    """Reads ``<run>.metrics`` from the start, incrementally (group-less)."""

    def __init__(self, bus: BusConfig, run: str):
        from kafka import KafkaConsumer, TopicPartition

        from relax.streams.client import consumer_kwargs

        self.tp = TopicPartition(topics.run_topic(run, topics.METRICS), 0)
        self.c = KafkaConsumer(**consumer_kwargs(bus, None, f"relax-train-{uuid.uuid4().hex[:6]}"))
        self.c.assign([self.tp])
        self.c.seek(self.tp, 0)
        self.rows: list[dict] = []

    def poll(self, timeout_s: float = 1.0) -> list[dict]:
        """New metric rows since the last call."""
        from relax.streams.codec import decode

        from relax.schemas.validate import SchemaError
        from relax.streams.codec import DecodeError

        new = []
        for m in self.c.poll(timeout_ms=int(timeout_s * 1000)).get(self.tp, []):
            try:
                new.extend(decode(m.value, "metrics").to_pylist())
            except (DecodeError, SchemaError) as e:  # not a metrics batch: not ours to stop on
                log.warning("skipping %s@%d: %s", self.tp.topic, m.offset, e)
        self.rows.extend(new)
        return new

    def close(self) -> None:
        self.c.close(autocommit=False)


def _publish_data(recipe: Recipe, bus: BusConfig, say: Callable[[str], None]) -> None:
    from relax.producers.publish import existing_prompt_ids, publish

    topic = topics.prompts_topic(recipe.data.dataset)
    ensure_topics(bus, {topic: recipe.data.partitions})
    n = len(existing_prompt_ids(bus, topic))
    if n:
        say(f"prompts: {topic} already holds {n} prompts")
        return
    if recipe.data.source is None:
        raise ValueError(f"{topic} is empty and data.source is not set: publish prompts first "
                         f"(relax publish SOURCE --topic {topic})")
    res = publish(bus, recipe.data.source, topic, prompt_field=recipe.data.prompt_field,
                  label_field=recipe.data.label_field, limit=recipe.data.limit,
                  partitions=recipe.data.partitions, progress=False)
    say(f"prompts: published={res.published} errors={res.errors} topic={topic}")


def _training_prompts(recipe: Recipe) -> set[str]:
    if recipe.data.source is None:
        return set()
    from relax.producers.sources import read_source

    out = set()
    for src in read_source(recipe.data.source, recipe.data.limit):
        if src.record and isinstance(src.record.get(recipe.data.prompt_field), str):
            out.add(src.record[recipe.data.prompt_field])
    return out


def _evaluate(recipe: Recipe, model: str, rows: list[dict]):
    from relax.infra.evaluate import greedy_accuracy

    ev = recipe.eval
    reward = ev.reward or next(r for r in recipe.rewards if r.weight)
    return greedy_accuracy(model, rows, reward_fn=reward.fn, reward_options=reward.options,
                           prompt_template=recipe.rollout.prompt_template,
                           max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size,
                           threshold=ev.threshold)


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


def train(recipe: Recipe, *, say: Callable[[str], None] = print,
          on_step: Callable[[dict, Path], None] | None = None,
          timeout_s: float | None = None) -> dict:
    """Run ``recipe`` to its end; returns the summary (also in ``summary.json``).

    Args:
        say: where progress lines go.
        on_step: called with each step's metrics and the run folder (tests use it to
            kill stages mid-run).
        timeout_s: give up after this many seconds (the stages are stopped either way).

    Raises:
        RunFailed: a stage failed (died, raised or stalled) more than ``max_restarts``
            times, or no optimizer step for ``recipe.step_timeout_s``; the message says
            which stage and why, then the latest metrics of every stage.
        RunTimeout: ``timeout_s`` passed (the same report).
        relax.infra.recipe.RecipeError: before anything starts, when a name in the recipe
            does not resolve (:func:`relax.infra.preflight.preflight`).
    """
    preflight(recipe)
    from kafka.errors import KafkaError

    from relax.infra.report import (
        accounting,
        plot_curves,
        stall_report,
        step_rows,
        write_metrics_jsonl,
    )

    run_dir = Path(recipe.run_root) / recipe.run
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"),
                                                        sort_keys=False))
    t_start = time.time()
    summary: dict = {"run": recipe.run, "mode": recipe.mode, "run_dir": str(run_dir)}
    say(f"run: {recipe.run} (folder {run_dir})")
    with contextlib.ExitStack() as stack:
        if recipe.bootstrap_servers:
            bootstrap = recipe.bootstrap_servers
        else:
            bootstrap = stack.enter_context(LocalBroker()).bootstrap
            say(f"broker: started a local broker at {bootstrap}")
        bus = BusConfig(bootstrap_servers=bootstrap, max_message_bytes=recipe.max_message_bytes,
                        blob_store=str(run_dir / "blobs"))
        ensure_topics(bus, run_topics(recipe))
        _publish_data(recipe, bus, say)
        eval_rows = None
        if recipe.eval is not None:
            from relax.infra.evaluate import eval_rows as load_eval_rows

            ev = recipe.eval
            eval_rows = load_eval_rows(ev.source, ev.size, prompt_field=ev.prompt_field,
                                       label_field=ev.label_field,
                                       exclude_prompts=_training_prompts(recipe))
            if ev.before:
                r = _evaluate(recipe, recipe.model, eval_rows)
                summary["eval_before"] = {"accuracy": r.accuracy, "correct": r.correct, "n": r.n,
                                          "seconds": round(r.seconds, 1), "examples": r.examples}
                say(f"eval before: greedy held-out accuracy {r.correct}/{r.n} = {r.accuracy:.3f} "
                    f"({r.seconds:.0f}s)")
        follower = MetricsFollower(bus, recipe.run)
        stack.callback(follower.close)
        controller = Controller(stage_specs(recipe, bus, run_dir), bus, run_dir,
                                address=recipe.ray_address, max_restarts=recipe.max_restarts,
                                stall_timeout_s=recipe.stall_timeout_s)
        stack.callback(controller.stop)
        stopping = {"flag": False}

        def _sigterm(*_):
            stopping["flag"] = True

        old = signal.signal(signal.SIGTERM, _sigterm)
        stack.callback(signal.signal, signal.SIGTERM, old)
        t_train = time.time()
        summary["train_started_at"] = t_train  # epoch seconds: step times relative to it
        controller.start()
        say(f"stages: {', '.join(controller.stages)} (pids in {run_dir / 'stages.json'})")
        printed: set[int] = set()
        done = False
        last_step = watched = time.monotonic()
        metrics_topic = topics.run_topic(recipe.run, topics.METRICS)
        seen_records: int | None = None
        unreachable_since: float | None = None

        def failed(cls: type[RunFailed], why: str) -> RunFailed:
            follower.poll(0.5)
            return cls(f"run {recipe.run} {why}, at step {len(printed)} of "
                       f"{recipe.trainer.steps}.\nstages:\n{controller.describe()}\n"
                       f"latest metrics:\n"
                       + (stall_report(follower.rows, int(time.time() * 1000))
                          or "(none written yet)"))

        while not done and not stopping["flag"]:
            if timeout_s is not None and time.time() - t_start > timeout_s:
                raise failed(RunTimeout, f"did not finish in {timeout_s}s")
            if recipe.step_timeout_s and time.monotonic() - last_step > recipe.step_timeout_s:
                raise failed(RunFailed, f"made no optimizer step for {recipe.step_timeout_s:.0f}s")
            try:
                finished = controller.check(0.2)
                if time.monotonic() - watched > WATCH_EVERY_S:
                    watched = time.monotonic()
                    try:
                        records = _metrics_records(bus, metrics_topic)
                    except (KafkaError, TimeoutError) as e:
                        unreachable_since = unreachable_since or time.monotonic()
                        if time.monotonic() - unreachable_since > BROKER_GONE_S:
                            raise failed(RunFailed, f"lost its broker: {bootstrap} has not "
                                         f"answered for {BROKER_GONE_S:.0f}s ({e})") from None
                        continue
                    unreachable_since = None
                    if broker_state_lost(seen_records, records):
                        raise failed(RunFailed, _broker_lost_text(
                            recipe, run_dir, bootstrap, seen_records, records))
                    seen_records = max(seen_records or 0, records or 0)
                    for line in controller.watch():
                        say(f"restarted {line}")
            except StageFailed as e:
                raise failed(RunFailed, f"failed: {e}") from None
            rows = follower.poll(0.5)
            for s in step_rows(follower.rows):
                if s["step"] not in printed:
                    printed.add(s["step"])
                    last_step = time.monotonic()
                    say(step_line(s, recipe.trainer.steps))
                    if on_step is not None:
                        on_step(s, run_dir)
            done = "trainer" in finished or any(
                r["component"] == "trainer" and r["name"] == "done" for r in rows)
        summary["train_s"] = round(time.time() - t_train, 1)
        controller.stop()
        follower.poll(1.0)
        summary.update(_accounting(bus, recipe, run_dir, accounting))
        steps = step_rows(follower.rows)
        summary["steps"] = len(steps)
        if steps:
            total_rows = sum(s.get(M.SAMPLES_TRAINED, 0) for s in steps)
            summary["samples_per_s"] = round(total_rows / max(summary["train_s"], 1e-9), 3)
            waits = [s.get(M.DATA_WAIT_S, 0) / max(s.get(M.STEP_S, 1e-9), 1e-9) for s in steps]
            summary["trainer_wait_pct"] = round(100 * sum(waits) / len(waits), 1)
        final = run_dir / "final_model"
        if eval_rows is not None and recipe.eval.after and final.exists():
            _save_tokenizer(recipe.model, final)
            r = _evaluate(recipe, str(final), eval_rows)
            summary["eval_after"] = {"accuracy": r.accuracy, "correct": r.correct, "n": r.n,
                                     "seconds": round(r.seconds, 1), "examples": r.examples}
            say(f"eval after: greedy held-out accuracy {r.correct}/{r.n} = {r.accuracy:.3f} "
                f"({r.seconds:.0f}s)")
        write_metrics_jsonl(run_dir / "metrics.jsonl", follower.rows)
        plot_curves(run_dir / "curves.png", steps,
                    summary.get("eval_before", {}).get("accuracy"),
                    summary.get("eval_after", {}).get("accuracy"))
    summary["wall_s"] = round(time.time() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _metrics_records(bus: BusConfig, topic: str) -> int | None:
    """Records in the run's metrics topic, None when the topic does not exist.

    Raises:
        kafka.errors.KafkaError, TimeoutError: the broker does not answer.
    """
    from relax.streams.client import topic_partitions
    from relax.streams.lag import high_watermarks

    if topic not in topic_partitions(bus, [topic]):
        return None
    return high_watermarks(bus, [topic], timeout_s=5.0).get((topic, 0), 0)


def _broker_lost_text(recipe: Recipe, run_dir: Path, bootstrap: str, seen: int,
                      now: int | None) -> str:
    """Why the run stops after its broker lost the topics, what was lost, how to go on;
    the newest checkpoint gets the tokenizer so it loads as a model."""
    from relax.trainer import checkpoint

    now_txt = "is gone" if now is None else f"holds {now} records"
    ckpt = checkpoint.latest(run_dir)
    if ckpt is not None:
        _save_tokenizer(recipe.model, ckpt)
        kept = (f"Kept: the trainer's checkpoint {ckpt} (policy_version "
                f"{int(ckpt.name.split('_')[-1])}, loads as a model). To go on, either "
                f"start a fresh run from those weights: relax train RECIPE model={ckpt} "
                f"run=NEW (prompts are published again), or replay an archive made "
                f"before the restart: relax replay ARCHIVE --run NEW.")
    else:
        kept = "No trainer checkpoint was written yet: start the run again."
    return (f"lost its broker's state: {bootstrap} was restarted (the metrics topic had "
            f"{seen} records and now {now_txt}; the local broker keeps topics in memory "
            f"only). Lost: every prompt, rollout, reward and train sample on the bus, the "
            f"aggregator's partial groups and the consumer offsets. {kept}")


def _save_tokenizer(model: str, folder: Path) -> None:
    from relax.trainer.models import load_tokenizer

    if not (folder / "tokenizer_config.json").exists():
        load_tokenizer(model).save_pretrained(folder)


def _accounting(bus: BusConfig, recipe: Recipe, run_dir: Path, accounting) -> dict:
    from relax.streams.read import read_table
    from relax.trainer import checkpoint

    sampled = set(read_table(bus, topics.run_topic(recipe.run, topics.ROLLOUTS))
                  .column("rollout_id").to_pylist())
    ckpt = checkpoint.latest(run_dir)
    if ckpt is None:
        return accounting(sampled, {}, set())
    from relax.trainer.ledger import Ledger

    ledger = Ledger.load(ckpt / "ledger.parquet")
    return accounting(sampled, ledger.counts(), ledger.ids())


def final_line(summary: dict) -> str:
    """``steps=S sampled=N trained=T stale=A filtered=B errors=E``."""
    return (f"steps={summary.get('steps', 0)} sampled={summary.get('sampled', 0)} "
            f"trained={summary.get('trained', 0)} stale={summary.get('stale', 0)} "
            f"filtered={summary.get('filtered', 0)} errors={summary.get('errors', 0)}")


__all__ = ["RunFailed", "RunTimeout", "final_line", "run_topics", "step_line", "train"]

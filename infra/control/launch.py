"""``relax train``: wire a run together and drive it to its end.

1. a broker (the recipe's ``bootstrap_servers``, or a local Apache Kafka started here,
   its data in the run folder's ``broker/``);
2. the run's topics, created with their partition counts;
3. the training prompts published into ``prompts.<dataset>`` if that topic is empty;
4. greedy held-out accuracy of the initial model (``eval.before``; also a row of
   ``<run>.metrics`` at policy_version 0, the first point of ``eval.every``'s curve,
   whose later points the ``eval`` stage writes: :mod:`relax.infra.control.eval_stage`);
5. every stage as its own process under the :class:`~relax.infra.control.controller.Controller`
   (restarted if it dies), while this process follows ``<run>.metrics`` and prints a
   line per optimizer step;
6. when the trainer has made its last step: stop everything, evaluate the final
   model, write the run folder (metrics.jsonl, curves.png, summary.json) and print
   ``steps=S sampled=N trained=T stale=A filtered=B errors=E``.

A run whose driver died goes on with ``relax train --resume RUN``
(:mod:`relax.infra.control.resume`): the same steps on the same folder and topics, given a
:class:`~relax.infra.control.resume.Resumed` (the local broker that outlived the driver, the eval
before it measured).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import yaml

from relax.infra.broker.local import BROKER_DIR, BrokerHandle, LocalBroker, stop_broker
from relax.infra.control.controller import Controller, StageFailed
from relax.infra.control.eval_stage import last_due, publish_eval, wait_for_last_eval
from relax.infra.control.resume import DRIVER_FILE, EVAL_BEFORE_FILE, Resumed
from relax.infra.control.run_watch import (
    MetricsFollower,
    RunFailed,
    RunTimeout,
    RunWatch,
    save_tokenizer,
    step_line,
)
from relax.infra.observe.cpu_timeline import CpuTimeline, run_processes
from relax.infra.observe.report import step_rows
from relax.infra.offline.evaluate import eval_metrics
from relax.infra.recipe.preflight import check_bus, preflight
from relax.infra.recipe.recipe import Recipe, RecipeError, RewardSpec
from relax.infra.recipe.specs import disk_warnings, run_bus, run_topics, stage_specs
from relax.schemas import metric_names as M
from relax.schemas import topics
from relax.streams.client import BusConfig, ensure_topics
from relax.streams.weights.shm_folders import SHM_ROOT, remove_run_files

log = logging.getLogger(__name__)

def _publish_data(recipe: Recipe, bus: BusConfig, say: Callable[[str], None]) -> None:
    from relax.producers.publish import existing_prompt_ids, publish

    topic = topics.prompts_topic(recipe.data.dataset)
    ensure_topics(bus, {topic: recipe.data.partitions})
    existing = existing_prompt_ids(bus, topic)
    if existing:
        say(f"prompts: {topic} already holds {len(existing)} prompts")
        _warn_if_the_source_differs(recipe, existing, topic, say)
        return
    if recipe.data.source is None:
        raise ValueError(f"{topic} is empty and data.source is not set: publish prompts first "
                         f"(relax publish SOURCE --topic {topic})")
    d = recipe.data
    res = publish(bus, d.source, topic, prompt_field=d.prompt_field, label_field=d.label_field,
                  limit=d.limit, partitions=d.partitions, progress=False,
                  media=d.media())
    notes = ([f"skipped {res.repeated} rows repeating an earlier prompt"] if res.repeated else [])
    if res.errors:
        notes.append(f"first error: {res.first_error}; see `relax errors {topic}`")
    say(f"prompts: published={res.published} errors={res.errors} topic={topic}"
        + "".join(f" ({n})" for n in notes))


def _warn_if_the_source_differs(recipe: Recipe, existing: set[str], topic: str,
                                say: Callable[[str], None]) -> None:
    """A ``warning:`` line when ``data.source`` holds prompts the topic does not: the run
    trains on the topic's, which the source no longer describes."""
    from relax.producers.prompt_rows import usable_rows

    d = recipe.data
    if d.source is None:
        return
    ids = {r["prompt_id"] for r in usable_rows(
        d.source, prompt_field=d.prompt_field, label_field=d.label_field,
        media=d.media(), limit=d.limit) if r is not None}
    if ids - existing:
        say(f"warning: {len(ids - existing)} of data.source's {len(ids)} prompts are not in "
            f"{topic}; the run trains on the {len(existing)} published there. To train on "
            f"the source: another data.dataset, or `relax publish {d.source} --topic {topic} "
            "--force` first")


def _training_keys(recipe: Recipe) -> set[tuple]:
    """The training prompts' keys (``infra/offline/evaluate.py::prompt_key``), to keep out
    of eval."""
    if recipe.data.source is None:
        return set()
    from relax.infra.offline.evaluate import source_keys

    d = recipe.data
    return source_keys(d.source, prompt_field=d.prompt_field, label_field=d.label_field,
                       media=d.media(), limit=d.limit)


def _eval_reward(recipe: Recipe) -> tuple[str, RewardSpec]:
    """The eval reward and its recipe key: ``eval.reward``, else the first counted reward
    not given by the environment."""
    return recipe.eval_reward()


def eval_pool(recipe: Recipe):
    """The eval reward's :class:`~relax.consumers.reward.pool.RewardPool` (one worker, the
    reward's time and memory limits), started: its warm-up call has run.

    Raises:
        RecipeError: the reward fails to load or warm up (``<key>.fn: ...``).
    """
    from relax.consumers.reward.pool import RewardLoadError, RewardPool

    key, reward = _eval_reward(recipe)
    try:
        return RewardPool(reward.fn, reward.options, workers=1,
                          batch_rows=recipe.eval.batch_size, timeout_s=reward.timeout_s,
                          memory_limit_bytes=reward.memory_limit_bytes,
                          startup_timeout_s=reward.startup_timeout_s)
    except RewardLoadError as e:
        raise RecipeError(f"{key}.fn: {e}") from None


def _warm_eval_pool(recipe: Recipe, rows: list[dict] | None, stack: contextlib.ExitStack):
    """The eval reward's pool for ``eval.before`` (None without it), started before
    anything is made, closed with ``stack`` at the latest."""
    if rows is None or not recipe.eval.before:
        return None
    pool = eval_pool(recipe)
    stack.callback(pool.close)
    return pool


def evaluate_held_out(recipe: Recipe, model: str, rows: list[dict], pool=None):
    """Greedy accuracy of ``model`` on ``rows``
    (:func:`relax.infra.offline.evaluate.greedy_accuracy`) with the eval reward, scored
    through ``pool`` (else one started here and closed).

    Raises:
        RecipeError: the reward fails to load or warm up.
        RunFailed: the reward fails on every row; one line naming its recipe key.
    """
    from relax.infra.offline.evaluate import greedy_accuracy

    ev = recipe.eval
    key, reward = _eval_reward(recipe)
    with contextlib.ExitStack() as stack:
        if pool is None:
            pool = stack.enter_context(eval_pool(recipe))
        r = greedy_accuracy(model, rows, pool=pool,
                            prompt_template=recipe.rollout.prompt_template,
                            max_new_tokens=ev.max_new_tokens, batch_size=ev.batch_size,
                            threshold=ev.threshold)
    if r.n and r.errors == r.n:
        raise RunFailed(f"eval: {key}.fn {reward.fn!r} failed on every one of the {r.n} eval "
                        f"rows; the first: {r.first_error}")
    return r


class StartupLaps:
    """Where a run's start-up time goes: ``lap(name)`` records the seconds since the last
    lap (or since it was made) under ``name`` in :attr:`seconds` (the summary's
    ``startup_s``: ``preflight``, ``held_out``, ``bus`` (broker, topics, prompts),
    ``eval_before``, ``specs``, ``ray_and_stages``, ``first_step`` (the stages' model loads,
    first sampling and first optimizer step, until the driver sees its metrics)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.time()

    def __call__(self, name: str) -> None:
        now = time.time()
        self.seconds[name], self._last = round(now - self._last, 2), now

    def first_step(self, on_step: Callable[[dict, Path], None] | None,
                   say: Callable[[str], None]) -> Callable[[dict, Path], None]:
        """``on_step`` that first records the ``first_step`` lap and says the start-up's
        laps once."""

        def step(metrics: dict, run_dir: Path) -> None:
            if "first_step" not in self.seconds:
                self("first_step")
                say(f"first step after {sum(self.seconds.values()):.1f} s: " + ", ".join(
                    f"{k} {v:.1f}" for k, v in self.seconds.items()))
            if on_step is not None:
                on_step(metrics, run_dir)

        return step


def train(recipe: Recipe, *, say: Callable[[str], None] = print,
          on_step: Callable[[dict, Path], None] | None = None,
          timeout_s: float | None = None, resumed: Resumed | None = None) -> dict:
    """Run ``recipe`` to its end; returns the summary (also in ``summary.json``).

    Args:
        say: where progress lines go.
        on_step: called with each step's metrics and the run folder (tests use it to
            kill stages mid-run).
        timeout_s: give up after this many seconds (the stages are stopped either way).
        resumed: the run goes on after its driver died (:func:`relax.infra.control.resume.
            prepare_resume` made this and checked the run folder and topics).

    Raises:
        RunFailed: a stage failed (died, raised or stalled) more than ``max_restarts``
            times, or no optimizer step for ``recipe.step_timeout_s``; the message says
            which stage and why, then the latest metrics of every stage.
        RunTimeout: ``timeout_s`` passed (the same report).
        relax.infra.recipe.recipe.RecipeError: before anything starts, when a name in the recipe
            does not resolve (:func:`relax.infra.recipe.preflight.preflight`), the recipe's
            cluster cannot be used (:func:`relax.infra.recipe.preflight.check_bus`), ``eval.source``
            has fewer than ``eval.size`` prompts outside the training data, or the eval
            reward fails to load or warm up (with ``eval.before``).
    """
    lap = StartupLaps()
    preflight(recipe)
    lap("preflight")
    t_start = time.time()
    held_out = held_out_rows(recipe)  # first: a short eval source is a recipe error
    summary: dict = {"run": recipe.run, "mode": recipe.mode, "resumed": resumed is not None,
                     "startup_s": lap.seconds}
    resumed = resumed or Resumed()
    with contextlib.ExitStack() as stack:
        pool = (None if resumed.eval_before  # a reward that cannot work: a recipe error too
                else _warm_eval_pool(recipe, held_out, stack))
        check_bus(recipe)  # the recipe's cluster answers with its credentials
        lap("held_out")
        run_dir = _run_folder(recipe, say)
        summary["run_dir"] = str(run_dir)
        broker: dict[str, int] = {}
        bus = _bus(recipe, run_dir, stack, say, broker, resumed.broker)  # broker, topics, prompts
        lap("bus")
        stack.callback(remove_run_files, SHM_ROOT, recipe.run)  # after the stages stop
        eval_rows = _eval_before(recipe, held_out, pool, summary, say, run_dir, bus,
                                 resumed.eval_before)
        lap("eval_before")
        board = None
        if recipe.telemetry.tensorboard:  # every other stage's rows (the trainer writes its own)
            from relax.trainer.telemetry import StageBoard

            board = stack.enter_context(contextlib.closing(StageBoard(run_dir)))
        follower = stack.enter_context(contextlib.closing(
            MetricsFollower(bus, recipe.run, sink=board.add if board else None)))
        controller = Controller(stage_specs(recipe, run_dir), bus, run_dir,
                                address=recipe.ray_address, max_restarts=recipe.max_restarts,
                                stall_timeout_s=recipe.stall_timeout_s)
        stack.callback(controller.stop)
        stopping = _sigterm_flag(stack)
        summary["train_started_at"] = t_train = time.time()  # step times are relative to it
        lap("specs")
        controller.start()
        lap("ray_and_stages")
        say(f"stages: {', '.join(controller.stages)} (pids in {run_dir / 'stages.json'})")
        for warning in disk_warnings(recipe, bus, controller.nodes(), controller.host()):
            say(f"warning: {warning}")
        # every process of the run on this host, each second (the sample costs ~10 ms)
        timeline = CpuTimeline(run_dir / "cpu_timeline.jsonl",
                               run_processes(broker, controller.local_pids), 1.0).start()
        stack.callback(timeline.close)
        watch = RunWatch(recipe, bus, run_dir, controller, follower, say,
                         lap.first_step(on_step, say), broker_pid=broker.get("broker"))
        if recipe.api.enabled:
            from relax.infra.control.scale_api import serve_run_api

            api = serve_run_api(recipe, run_dir, controller, watch)
            stack.callback(api.close)
            token = ("$RELAX_API_TOKEN" if os.environ.get("RELAX_API_TOKEN")
                     else run_dir / "api_token")
            say(f"api: {api.url} (token: {token}; relax scale {recipe.run} --instances N)")
        watch.until_done(stopping, None if timeout_s is None else t_start + timeout_s)
        if recipe.eval is not None and recipe.eval.every and not stopping():
            _last_eval(recipe, follower, controller, say)
        summary["train_s"] = round(time.time() - t_train, 1)
        timeline.close()
        summary["peak_rss_mb"] = timeline.peak_rss_mb()  # each process of the run on this host
        controller.stop()  # finish: accounting, eval after, run folder
        _finish(recipe, bus, run_dir, follower, eval_rows, summary, say)
    summary["wall_s"] = round(time.time() - t_start, 1)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def _run_folder(recipe: Recipe, say: Callable[[str], None]) -> Path:
    """``<run_root>/<run>/`` with the recipe as run (``recipe.yaml``)."""
    run_dir = Path(recipe.run_root) / recipe.run
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"),
                                                        sort_keys=False))
    say(f"run: {recipe.run} (folder {run_dir})")
    return run_dir


def _bus(recipe: Recipe, run_dir: Path, stack: contextlib.ExitStack,
         say: Callable[[str], None], broker: dict[str, int],
         adopted: BrokerHandle | None = None) -> BusConfig:
    """The run's bus (a local broker when the recipe names none: ``adopted``, the one a
    dead driver of the run started, else a new one; stopped with ``stack``, its pid put in
    ``broker``), :data:`DRIVER_FILE` written, the topics created and the training prompts
    published (unless the topic holds them)."""
    handle = None
    if recipe.bootstrap_servers:
        bootstrap = recipe.bootstrap_servers
    elif adopted is not None:
        handle = adopted
        stack.callback(stop_broker, handle)
        say(f"broker: the run's local broker at {handle.bootstrap} (pid {handle.pid}, "
            f"data in {handle.data_dir})")
    else:
        t0 = time.monotonic()
        handle = stack.enter_context(LocalBroker(data_dir=run_dir / BROKER_DIR))
        say(f"broker: started a local Apache Kafka at {handle.bootstrap} in "
            f"{time.monotonic() - t0:.1f}s (data in {handle.data_dir})")
    if handle is not None:
        bootstrap, broker["broker"] = handle.bootstrap, handle.pid
    (run_dir / DRIVER_FILE).write_text(json.dumps(
        {"pid": os.getpid(), "started_at": time.time(),
         "broker": asdict(handle) if handle is not None else None}))
    bus = run_bus(recipe, bootstrap, run_dir)
    ensure_topics(bus, run_topics(recipe))
    _publish_data(recipe, bus, say)
    return bus


def _eval_summary(r) -> dict:
    return {"accuracy": r.accuracy, "correct": r.correct, "n": r.n,
            "seconds": round(r.seconds, 1), "examples": r.examples, "reward_errors": r.errors,
            **({"first_error": r.first_error} if r.first_error else {})}


def eval_line(when: str, r) -> str:
    """``eval before: greedy held-out accuracy 56/200 = 0.280 (12s)``, with the rows whose
    reward failed (counted as wrong) and the first one's error when there are any."""
    failed = (f"; the reward failed on {r.errors} rows, counted as wrong (first: "
              f"{r.first_error})" if r.errors else "")
    return (f"eval {when}: greedy held-out accuracy {r.correct}/{r.n} = {r.accuracy:.3f} "
            f"({r.seconds:.0f}s){failed}")


def held_out_rows(recipe: Recipe) -> list[dict] | None:
    """The held-out rows (None without ``eval``): the first ``eval.size`` prompts of
    ``eval.source`` that are not training prompts.

    Raises:
        RecipeError: ``eval.size``: the source has fewer such prompts.
    """
    if recipe.eval is None:
        return None
    from relax.infra.offline.evaluate import TooFewEvalRows
    from relax.infra.offline.evaluate import eval_rows as load_eval_rows

    ev = recipe.eval
    try:
        return load_eval_rows(ev.source, ev.size, prompt_field=ev.prompt_field,
                              label_field=ev.label_field, exclude=_training_keys(recipe),
                              media=ev.media(recipe.data))
    except TooFewEvalRows as e:
        raise RecipeError(f"eval.size: {e}; lower eval.size or give more held-out prompts") \
            from None


def _eval_before(recipe: Recipe, rows: list[dict] | None, pool, summary: dict,
                 say: Callable[[str], None], run_dir: Path, bus: BusConfig,
                 known: dict | None = None) -> list[dict] | None:
    """``rows`` (the held-out rows, None without ``eval``); the initial model's accuracy
    on them when ``eval.before``: ``known`` (a dead driver of the run measured it), else
    scored through ``pool``, which is then closed (its worker would idle through the run),
    saved to :data:`EVAL_BEFORE_FILE` and written to ``<run>.metrics`` at policy_version 0
    (component ``eval``, the first point of the ``eval.every`` curve)."""
    if known is not None:
        summary["eval_before"] = known
        say(f"eval before: greedy held-out accuracy {known['correct']}/{known['n']} = "
            f"{known['accuracy']:.3f} (measured before the driver died: "
            f"{run_dir / EVAL_BEFORE_FILE})")
    elif pool is not None:
        with pool:
            r = evaluate_held_out(recipe, recipe.model, rows, pool)
        summary["eval_before"] = _eval_summary(r)
        (run_dir / EVAL_BEFORE_FILE).write_text(json.dumps(summary["eval_before"]))
        publish_eval(bus, recipe.run, eval_metrics(r), 0)
        say(eval_line("before", r))
    return rows


def _last_eval(recipe: Recipe, follower: MetricsFollower, controller: Controller,
               say: Callable[[str], None]) -> None:
    """After the trainer's last step: wait up to ``stall_timeout_s`` for the eval stage's
    row of the last version ``eval.every`` evaluates; a line when it does not come (the
    run has trained: a stage failing now is reported, not raised)."""
    last = last_due(recipe.trainer.steps, recipe.eval.every)
    try:
        came = not last or wait_for_last_eval(follower, controller, last,
                                              recipe.stall_timeout_s)
    except StageFailed as e:
        say(f"eval: a stage failed while waiting for the last eval: {e}")
        return
    if not came:
        say(f"eval: no held-out accuracy of policy_version {last} within "
            f"{recipe.stall_timeout_s:.0f}s after the last step (logs/eval.log)")


def _sigterm_flag(stack: contextlib.ExitStack) -> Callable[[], bool]:
    """A flag SIGTERM sets (the handler is restored with ``stack``)."""
    stopping = {"flag": False}

    def _sigterm(*_):
        stopping["flag"] = True

    old = signal.signal(signal.SIGTERM, _sigterm)
    stack.callback(signal.signal, signal.SIGTERM, old)
    return lambda: stopping["flag"]


def _finish(recipe: Recipe, bus: BusConfig, run_dir: Path, follower: MetricsFollower,
            eval_rows: list[dict] | None, summary: dict, say: Callable[[str], None]) -> None:
    """Accounting, step figures, the final model's accuracy, metrics.jsonl, errors.jsonl
    (:mod:`relax.infra.control.run_errors`), curves.png and timeline.png (the stages' CPU use,
    :mod:`relax.infra.observe.cpu_timeline`)."""
    from relax.infra.control.run_errors import ERRORS_FILE, write_run_errors
    from relax.infra.observe.cpu_timeline import plot_timeline, read_timeline
    from relax.infra.observe.report import accounting, plot_curves, ts_ms, write_metrics_jsonl
    from relax.trainer import checkpoint

    follower.read_to_end()
    summary.update(_accounting(bus, recipe, run_dir, accounting))
    steps = step_rows(follower.rows)
    summary["steps"] = len(steps)
    if steps:
        total_rows = sum(s.get(M.SAMPLES_TRAINED, 0) for s in steps)
        summary["samples_per_s"] = round(total_rows / max(summary["train_s"], 1e-9), 3)
        waits = [s.get(M.DATA_WAIT_S, 0) / max(s.get(M.STEP_S, 1e-9), 1e-9) for s in steps]
        summary["trainer_wait_pct"] = round(100 * sum(waits) / len(waits), 1)
    final = run_dir / checkpoint.FINAL_MODEL
    store = recipe.trainer.checkpoint_store
    if eval_rows is not None and recipe.eval.after and store is not None and not final.exists():
        checkpoint.download(store, checkpoint.FINAL_MODEL, final)  # the trainer's host's
    if eval_rows is not None and recipe.eval.after and final.exists():
        save_tokenizer(recipe.model, final)
        try:
            r = evaluate_held_out(recipe, str(final), eval_rows)
        except (RunFailed, RecipeError) as e:  # the run is done: report it, keep its folder
            summary["eval_after_error"] = str(e)
            say(f"eval after: {e}")
        else:
            summary["eval_after"] = _eval_summary(r)
            say(eval_line("after", r))
    write_metrics_jsonl(run_dir / "metrics.jsonl", follower.rows)
    own = [t for t in run_topics(recipe) if t.startswith(f"{recipe.run}.")]  # not the prompts'
    counts = write_run_errors(bus, own, run_dir / ERRORS_FILE)
    summary["error_records"] = counts
    lost = int(sum(r["value"] for r in follower.rows if r["name"] == M.LOST_TO_RETENTION))
    summary["lost_to_retention"] = lost
    if lost:
        say(f"lost to retention: {lost} records deleted before a stage read them (the "
            f"stages' WARNINGs name each topic, partition, committed offset and log start)")
    if counts:
        say(f"errors: {sum(counts.values())} failed records in {run_dir / ERRORS_FILE} ("
            + ", ".join(f"{t}: {n}" for t, n in counts.items())
            + "; `relax errors TOPIC` while the broker runs)")
    ends = [ts_ms(r["ts"]) / 1000 for r in follower.rows
            if r["component"] == "trainer" and r["name"] == M.STEP_S]
    plot_timeline(read_timeline(run_dir / "cpu_timeline.jsonl"), run_dir / "timeline.png", ends)
    plot_curves(run_dir / "curves.png", steps, summary.get("eval_before", {}).get("accuracy"),
                summary.get("eval_after", {}).get("accuracy"))


def _accounting(bus: BusConfig, recipe: Recipe, run_dir: Path, accounting) -> dict:
    from relax.streams.read import read_table
    from relax.trainer import checkpoint

    sampled = set(read_table(bus, topics.run_topic(recipe.run, topics.ROLLOUTS))
                  .column("rollout_id").to_pylist())
    ckpt = checkpoint.latest(run_dir, recipe.trainer.checkpoint_store,
                             files=("ledger.parquet", checkpoint.STATE_FILE))
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

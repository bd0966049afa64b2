"""``relax train --resume RUN``: go on with a run whose driver died.

What a dead driver (``relax train``, SIGKILLed or its host rebooted) leaves behind: the
run folder (``recipe.yaml``, ``stages.json``, :data:`DRIVER_FILE`,
the trainer's checkpoints, :data:`EVAL_BEFORE_FILE`); the run's
topics with every stage's committed offsets on its broker; for a few seconds its stage
processes (Ray ends the actors of a dead driver: on one host 3 s after it, measured); and,
for a run without ``bootstrap_servers``, its local Apache Kafka, whose data is in the run
folder (:data:`relax.infra.broker.local.BROKER_DIR`): it runs in its own session, so it
outlives a driver killed alone; killed with every process of the run (a host's reboot),
it is started again from that folder with every topic and committed offset.

:func:`prepare_resume` checks the run can go on and refuses with one line
(:class:`ResumeRefused`) when it cannot: the driver still alive; the recipe changed
beyond :data:`MAY_CHANGE` (``trainer.steps=N`` is fine; another ``model`` or
``rollout.group_size`` is not); ``trainer.steps`` below the newest checkpoint; the run
already done; the run's topics gone (its local broker's folder deleted, or the cluster
lost or deleted them) once its stages had started. Then it stops the dead driver's stage
processes that still live and hands :func:`relax.infra.control.launch.train` a
:class:`Resumed`.

How the run goes on (nothing lost, nothing trained twice; one ledger over both parts):
the same topics and consumer groups, so every stage resumes from its committed offsets
(the aggregator also from its changelog); the trainer from its newest checkpoint, whose
ledger holds every rollout decided up to it, and whose input offsets were committed only
once it was in place, so what the dead part decided after it is decided again, once.
The prompts are not published again (their topic holds them); ``eval.before`` is taken
from the file the dead driver wrote, else measured again (the initial model's: the same).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import yaml

from relax.infra.broker.local import BrokerHandle, pid_alive, running, start_kafka, stop_pids
from relax.infra.recipe.preflight import preflight
from relax.infra.recipe.recipe import Recipe, load_recipe
from relax.infra.recipe.specs import run_bus, run_topics
from relax.schemas import topics

RUN_ROOT = "runs"
"""Where a run name (not a folder) is looked up: the default ``run_root``."""

MAY_CHANGE = ("trainer.steps", "bootstrap_servers", "run_root", "max_restarts",
              "stall_timeout_s", "step_timeout_s", "stuck.", "telemetry.", "api.")
"""Recipe keys (a trailing dot: every key under it) a resumed run may set to another
value: how long it trains and how it is watched and reached. Anything else (the model,
the data, group_size, rewards, partitions, the loss) would make its two parts two runs."""

DRIVER_FILE = "driver.json"
"""In the run folder: the driver's ``pid``, ``started_at`` (epoch seconds) and its local
``broker`` (a :class:`~relax.infra.broker.local.BrokerHandle` as a dict; null on a cluster the
recipe names), written before the stages start; what ``relax train --resume`` reads."""
EVAL_BEFORE_FILE = "eval_before.json"
"""In the run folder: ``eval.before``'s result (``summary.json``'s ``eval_before``), written
as soon as it is measured, so a resumed run does not measure it again."""


@dataclass(frozen=True)
class Resumed:
    """What a resumed run (this module) takes over from its dead driver.

    Attributes:
        broker: the run's local broker, still running (the driver started it in its own
            session) or started again from its folder: used instead of a new one, and
            stopped at the end. None on a cluster the recipe names.
        eval_before: ``eval.before``'s result as the dead driver saved it
            (:data:`EVAL_BEFORE_FILE`); None: measured (again).
    """

    broker: BrokerHandle | None = None
    eval_before: dict | None = None


class ResumeRefused(ValueError):
    """A run that cannot be resumed; the message is one line saying why."""


def run_folder(run: str) -> Path:
    """The folder of run ``run``: ``run`` itself when it holds ``recipe.yaml``, else
    ``runs/<run>`` (:data:`RUN_ROOT`).

    Raises:
        ResumeRefused: neither holds a ``recipe.yaml``.
    """
    places = list(dict.fromkeys([Path(run), Path(RUN_ROOT) / run]))
    for d in places:
        if (d / "recipe.yaml").is_file():
            return d.resolve()
    raise ResumeRefused(f"{run}: no run there (no " + " nor ".join(
        str(d / "recipe.yaml") for d in places) + "); give the run's folder or its name "
        f"under {RUN_ROOT}/")


def recipe_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple]:
    """``{dotted key: (old value, new value)}`` for every key whose value differs between
    two recipe trees (``Recipe.model_dump(mode="json")``); lists compare whole."""
    out: dict[str, tuple] = {}
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(recipe_changes(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = (a, b)
    return out


def refused_changes(changes: dict[str, tuple]) -> dict[str, tuple]:
    """The ``changes`` a resumed run may not make (keys not under :data:`MAY_CHANGE`)."""
    return {k: v for k, v in changes.items()
            if not any(k == m or (m.endswith(".") and k.startswith(m)) for m in MAY_CHANGE)}


def _short(v) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def process_started_at(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, from ``/proc``); None when
    there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except OSError:
        return None
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _same_process(pid: int, seen_at: float) -> bool:
    """Whether ``pid`` is alive and started by ``seen_at`` (epoch seconds) when it was
    recorded; a pid the system gave to a process started since is not it."""
    started = process_started_at(pid)
    return started is not None and started <= seen_at + 1.0 and pid_alive(pid)


def stop_stage_orphans(run_dir: Path, wait_s: float = 10.0) -> dict[str, int]:
    """SIGTERM (SIGKILL after ``wait_s``) the stage processes in ``stages.json`` that
    still run: Ray stage actors (``ray::StageActor``) started before the file was last
    written; returns ``{stage: pid}`` of those stopped."""
    path = run_dir / "stages.json"
    if not path.exists():
        return {}
    written = path.stat().st_mtime
    left = {}
    for name, s in json.loads(path.read_text()).items():
        pid = int(s.get("pid") or 0)
        if pid and _same_process(pid, written) and b"StageActor" in _cmdline(pid):
            left[name] = pid
    stop_pids(list(left.values()), wait_s)
    return left


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _newest_checkpoint(recipe: Recipe, run_dir: Path) -> tuple[Path | None, int | None]:
    """The trainer's newest complete checkpoint (its ``trainer_state.json`` only, from a
    store) and its policy_version; ``(None, None)`` before the first."""
    from relax.trainer import checkpoint

    ckpt = checkpoint.latest(run_dir, recipe.trainer.checkpoint_store,
                             files=(checkpoint.STATE_FILE,))
    return ckpt, None if ckpt is None else int(ckpt.name.split("_")[-1])


def _check_recipe(run: str, run_dir: Path, recipe: Recipe, version: int | None) -> None:
    """Refuse changes beyond :data:`MAY_CHANGE`, steps below ``version`` (the newest
    checkpoint's) and a run already done.

    Raises:
        ResumeRefused: one line.
    """
    old = yaml.safe_load((run_dir / "recipe.yaml").read_text())
    bad = refused_changes(recipe_changes(old, recipe.model_dump(mode="json")))
    if bad:
        raise ResumeRefused(
            f"cannot resume {run}: the recipe changed " + ", ".join(
                f"{k} ({_short(a)} -> {_short(b)})" for k, (a, b) in bad.items())
            + f"; a resumed run may change only {', '.join(MAY_CHANGE)} (the rest makes "
            "another run: start one with relax train RECIPE run=NEW)")
    if version is not None and recipe.trainer.steps < version:
        raise ResumeRefused(f"cannot resume {run}: trainer.steps={recipe.trainer.steps} is "
                            f"below its newest checkpoint's policy_version {version}")
    summary = run_dir / "summary.json"
    if summary.exists():
        done = json.loads(summary.read_text()).get("steps", 0)
        if done >= recipe.trainer.steps:
            raise ResumeRefused(f"cannot resume {run}: it finished its {done} steps "
                                f"({summary}); to train on, raise trainer.steps=N")


def _check_driver_dead(run: str, record: dict) -> None:
    """Raises ResumeRefused: the driver recorded in ``record`` still runs."""
    pid = record.get("pid")
    if pid and _same_process(int(pid), float(record.get("started_at", 0))):
        raise ResumeRefused(f"cannot resume {run}: its driver (relax train, pid {pid}) still "
                            f"runs; stop it first (kill {pid}), or let it finish")


def _broker(run: str, recipe: Recipe, record: dict, started: bool,
            ckpt: Path | None, say: Callable[[str], None]) -> BrokerHandle | None:
    """The run's local broker to go on with: still running, or started again from its
    folder (its topics and offsets kept); None: the recipe names a cluster, or none was
    needed yet (a new one will be started). ``ckpt``: the newest checkpoint, named in the
    refusal.

    Raises:
        ResumeRefused: the stages had started and the local broker's folder is gone, or
            it does not start again.
    """
    if recipe.bootstrap_servers:
        return None
    h = BrokerHandle(**record["broker"]) if record.get("broker") else None
    if h is not None and running(h):
        return h
    if h is not None and h.data_dir and (Path(h.data_dir) / "cluster.json").exists():
        try:
            h = start_kafka(h.data_dir)
        except (FileNotFoundError, OSError, TimeoutError) as e:
            raise ResumeRefused(f"cannot resume {run}: its local broker in {h.data_dir} "
                                f"did not start again ({type(e).__name__}: {e})") from None
        say(f"resume: started the run's local broker again from {h.data_dir} "
            f"at {h.bootstrap}")
        return h
    if not started:
        return None
    where = f" (its folder {h.data_dir})" if h is not None and h.data_dir else ""
    again = (f"start a new run from its newest checkpoint (relax train RECIPE model={ckpt} "
             "run=NEW)" if ckpt is not None else "start the run again")
    raise ResumeRefused(
        f"cannot resume {run}: its local broker{where} is gone, and with it every topic "
        f"of the run (rollouts, rewards, consumer offsets, prompts); {again}")


def _check_topics(run: str, recipe: Recipe, bootstrap: str, run_dir: Path) -> None:
    """Raises ResumeRefused: the broker does not answer, or lacks one of the run's
    topics, or its prompts topic is empty."""
    from kafka.errors import KafkaError

    from relax.streams.client import list_topics
    from relax.streams.lag import high_watermarks

    bus = run_bus(recipe, bootstrap, run_dir)
    prompts = topics.prompts_topic(recipe.data.dataset)
    try:
        present = set(list_topics(bus))
        missing = sorted(t for t in [*run_topics(recipe), prompts] if t not in present)
        held = 0 if prompts in missing else sum(high_watermarks(bus, [prompts]).values())
    except (KafkaError, TimeoutError) as e:
        raise ResumeRefused(f"cannot resume {run}: its broker {bootstrap} does not answer "
                            f"({type(e).__name__}: {e})") from None
    if missing or not held:
        gone = (f"{len(missing)} of its topics are missing ({', '.join(missing[:3])}"
                f"{', ...' if len(missing) > 3 else ''})" if missing else f"{prompts} is empty")
        raise ResumeRefused(f"cannot resume {run}: {gone} on {bootstrap}: the broker lost or "
                            "deleted them (a broker restarted without its data, another "
                            "cluster?), so what the run had sampled and committed is gone")


def prepare_resume(run: str, overrides: list[str] = (),
                   say: Callable[[str], None] = print) -> tuple[Recipe, Resumed]:
    """Check that run ``run`` (its folder, or its name under ``runs/``) can go on with
    ``overrides`` (``key=value``, the :data:`MAY_CHANGE` keys), stop its dead driver's
    stage processes, and return its recipe and what :func:`relax.infra.control.launch.train`
    takes over (module docstring).

    Raises:
        ResumeRefused: it cannot go on (one line saying why).
        relax.infra.recipe.recipe.RecipeError, ValueError: an override that does not parse or
            validate, a name that does not resolve (:func:`relax.infra.recipe.preflight.preflight`).
    """
    run_dir = run_folder(run)
    recipe = load_recipe(run_dir / "recipe.yaml", [*overrides, f"run_root={run_dir.parent}"])
    preflight(recipe)  # a reward that no longer imports: before anything is stopped
    ckpt, version = _newest_checkpoint(recipe, run_dir)
    _check_recipe(run, run_dir, recipe, version)
    driver = run_dir / DRIVER_FILE
    record = json.loads(driver.read_text()) if driver.exists() else {}
    _check_driver_dead(run, record)
    stopped = stop_stage_orphans(run_dir)
    if stopped:
        say("resume: stopped the dead driver's stage processes " + ", ".join(
            f"{n} (pid {p})" for n, p in stopped.items()))
    started = (run_dir / "stages.json").exists()
    broker = _broker(run, recipe, record, started, ckpt, say)
    bootstrap = recipe.bootstrap_servers or (broker.bootstrap if broker else None)
    if started and bootstrap:
        _check_topics(run, recipe, bootstrap, run_dir)
    before = run_dir / EVAL_BEFORE_FILE
    eval_before = json.loads(before.read_text()) if before.exists() else None
    say(f"resume: {recipe.run} in {run_dir}, the trainer from "
        + (f"its checkpoint at policy_version {version}" if version is not None
           else "the start (no checkpoint yet)")
        + f", {recipe.trainer.steps} steps in all")
    return recipe, Resumed(broker=broker, eval_before=eval_before)

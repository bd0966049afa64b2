"""Chaos runs: a recipe run while stage processes are SIGKILLed at random moments, and
what became of every rollout.

A :class:`KillPlan` names, for one run, which stage to kill after which optimizer step
and how long after that step's line (seconds); :func:`plan_kills` draws one from a seed
(one kill, two stages, or the same stage twice). :func:`chaos_run` runs the recipe with
:func:`relax.infra.launch.train`, kills as planned (the pid is read from the run's
``stages.json`` at kill time, so a second kill hits the restarted process), and reports:

* ``finished``: the run reached its last step;
* ``sampled`` / ``trained`` / ``stale`` / ``filtered`` / ``errors``: the fate of every
  rollout written to ``<run>.rollouts`` (from the trainer's ledger);
* ``lost``: sampled but in no ledger bucket; ``trained_twice``: rows counted by the
  trainer's steps beyond the rollouts its ledger holds as trained (a row trained in two
  steps that both count);
* ``wall_s``: seconds of the whole run.

``benchmarks/chaos.py`` runs many of them; ``tests/e2e/test_chaos.py`` a few seeded ones.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from relax.infra.recipe import Recipe
from relax.schemas import metric_names as M

STAGES = ("rollout-0", "reward.parity", "aggregate", "trainer")
"""Stages of the tiny chaos recipe that a plan may kill (``reference`` too when the
recipe has a reference stage)."""


@dataclass(frozen=True)
class Kill:
    """SIGKILL ``stage`` ``delay_s`` seconds after optimizer step ``after_step`` is seen."""

    stage: str
    after_step: int
    delay_s: float


@dataclass
class ChaosResult:
    """What one chaos run did (see the module docstring for each count)."""

    run: str
    kills: list[Kill]
    killed: list[str] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    sampled: int = 0
    trained: int = 0
    stale: int = 0
    filtered: int = 0
    errors: int = 0
    lost: int = 0
    trained_twice: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def plan_kills(rng: random.Random, steps: int, stages: tuple[str, ...] = STAGES) -> list[Kill]:
    """Draw the kills of one run: one stage (half the runs), two stages, or one stage
    twice, each after a random step in ``1..steps-1`` and a delay in [0, 2) s.

    Raises:
        ValueError: ``steps`` < 2 (no moment between steps to kill at).
    """
    if steps < 2:
        raise ValueError(f"a chaos run needs steps >= 2, got {steps}")
    kind = rng.choice(["one", "one", "two", "twice"])
    first = rng.choice(stages)
    if kind == "one":
        names = [first]
    elif kind == "two":
        names = [first, rng.choice([s for s in stages if s != first])]
    else:
        names = [first, first]
    at = sorted(rng.randint(1, steps - 1) for _ in names)
    if kind == "twice" and at[0] == at[1]:  # the restarted process needs time to exist
        at = [at[0], at[0] + 1] if at[0] + 1 < steps else [at[0] - 1, at[0]]
        at = [max(1, a) for a in at]
    return [Kill(n, a, round(rng.uniform(0.0, 2.0), 2)) for n, a in zip(names, at)]


def _killer(kills: list[Kill], result: ChaosResult):
    """An ``on_step`` callback for :func:`train` that fires the planned kills."""
    pending = list(kills)
    timers: list[threading.Timer] = []

    def fire(k: Kill, run_dir: Path) -> None:
        stages = json.loads((run_dir / "stages.json").read_text())
        if k.stage not in stages or stages[k.stage].get("finished"):
            return
        try:
            os.kill(stages[k.stage]["pid"], signal.SIGKILL)
            result.killed.append(f"{k.stage}@{k.after_step}+{k.delay_s}s")
        except ProcessLookupError:  # already gone (died and restarting): nothing to kill
            pass

    def on_step(s: dict, run_dir: Path) -> None:
        for k in [k for k in pending if k.after_step == int(s["step"])]:
            pending.remove(k)
            t = threading.Timer(k.delay_s, fire, (k, run_dir))
            t.daemon = True
            timers.append(t)
            t.start()

    return on_step, timers


def chaos_run(recipe: Recipe, kills: list[Kill], timeout_s: float = 600.0,
              also: Callable[[dict, Path], None] | None = None) -> ChaosResult:
    """Run ``recipe`` with ``kills``; never raises for a run that fails (the error is in
    the result). ``also(step_row, run_dir)`` is called after each step's kills are
    planned (a fault that is not a stage kill: a broker node killed or restarted)."""
    from relax.infra.launch import RunFailed, train

    result = ChaosResult(recipe.run, kills)
    kill_on_step, timers = _killer(kills, result)

    def on_step(s: dict, run_dir: Path) -> None:
        kill_on_step(s, run_dir)
        if also is not None:
            also(s, run_dir)

    t0 = time.monotonic()
    try:
        s = train(recipe, say=lambda _: None, on_step=on_step, timeout_s=timeout_s)
    except RunFailed as e:
        result.error = str(e)[:4000]
        result.wall_s = round(time.monotonic() - t0, 1)
        return result
    finally:
        for t in timers:
            t.cancel()
    result.wall_s = round(time.monotonic() - t0, 1)
    result.finished = s.get("steps") == recipe.trainer.steps
    for k in ("sampled", "trained", "stale", "filtered", "errors"):
        setattr(result, k, int(s.get(k, 0)))
    result.lost, result.trained_twice = lost_and_trained_twice(s)
    return result


def lost_and_trained_twice(summary: dict) -> tuple[int, int]:
    """``(lost, trained_twice)`` of a finished run (module docstring) from its summary
    (:func:`relax.infra.launch.train`'s) and its folder's ``metrics.jsonl``."""
    twice = _rows_trained(Path(summary["run_dir"])) - int(summary.get("trained", 0))
    return int(summary.get("unaccounted", 0)), max(0, twice)


def _rows_trained(run_dir: Path) -> int:
    """Rows the trainer's final steps trained (the latest record of each step)."""
    from relax.infra.report import step_rows

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return int(sum(s.get(M.SAMPLES_TRAINED, 0) for s in step_rows(rows)))

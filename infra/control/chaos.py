"""Chaos runs: a recipe run while stage processes are SIGKILLed at random moments, and
what became of every rollout.

A plan is a list of :class:`Kill`: which stage to kill after which optimizer step and
how long after that step's line (seconds); :func:`plan_kills` draws one from a seed
(one kill, two stages, or the same stage twice; early and late with ``window``; or one
broker fault). :func:`chaos_run` runs the recipe with :func:`relax.infra.control.launch.train`,
kills as planned (the pid is read from the run's ``stages.json`` at kill time, so a
second kill hits the restarted process) and fires broker faults on a local Apache Kafka:

* :data:`BROKER_RESTART`: every node SIGKILLed and started again from its log dirs
  3 s later (a durable broker: the run must finish whole);
* :data:`BROKER_NODE_LOST`: of a 3-node cluster (replication factor 3,
  ``min.insync.replicas`` 2), the leader of the trainer's input partition 0 SIGKILLed
  and left dead for the rest of the run.

It reports:

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

from relax.infra.broker.handle import BrokerHandle
from relax.infra.recipe.recipe import Recipe
from relax.schemas import metric_names as M

STAGES = ("rollout-0", "reward.parity", "aggregate", "trainer")
"""Stages of the tiny chaos recipe that a plan may kill (``reference`` too when the
recipe has a reference stage)."""

BROKER_RESTART = "broker:restart"
"""``Kill.stage`` of a broker fault: every node of the local Kafka SIGKILLed and started
again from its log dirs, same ports, 3 s later (the fault's thread waits until it is
ready, up to 120 s)."""

BROKER_NODE_LOST = "broker:node-lost"
"""``Kill.stage`` of a broker fault: the leader of partition 0 of the run's
``train_samples`` topic, one node of a 3-node Kafka, SIGKILLed and left dead."""

BROKER_FAULTS = (BROKER_RESTART, BROKER_NODE_LOST)
"""The broker faults :func:`chaos_run` fires (given the Kafka's handle)."""


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
    broker_outage_s: float | None = None
    """:data:`BROKER_RESTART`: seconds from the kill until every node was ready again"""
    broker_error: str | None = None
    """:data:`BROKER_RESTART`: why the broker could not be started again"""
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


def plan_kills(rng: random.Random, steps: int, stages: tuple[str, ...] = STAGES,
               window: int | None = None, broker: str | None = None) -> list[Kill]:
    """Draw the kills of one run, each after a step in ``1..steps-1`` and a delay in
    [0, 2) s (rounded to 0.01 s).

    Without ``broker``: one stage (half the runs), two stages, or one stage twice, from
    ``stages``. Each step is drawn uniformly, or, with ``window`` (the steps whose weight
    snapshots are still kept: ``weights_snapshot_every`` x 3), early (``1..window``) or
    late (``window+1..steps-1``, after the snapshot window has moved on) with even odds.
    With ``broker`` (:data:`BROKER_RESTART` or :data:`BROKER_NODE_LOST`): that one fault,
    its step drawn the same way. Deterministic for a seeded ``rng``; without ``window``
    and ``broker`` the draws are those of the first chaos plans (same seed, same plan).

    Raises:
        ValueError: ``steps`` < 2 (no moment between steps to kill at); ``window`` not in
            ``1..steps-2`` (no late step to draw); an unknown ``broker`` fault.
    """
    if steps < 2:
        raise ValueError(f"a chaos run needs steps >= 2, got {steps}")
    if window is not None and not 1 <= window <= steps - 2:
        raise ValueError(f"window must be in 1..steps-2 = 1..{steps - 2} (a late step "
                         f"after it, before the last), got {window}")
    if broker is not None and broker not in BROKER_FAULTS:
        raise ValueError(f"unknown broker fault {broker!r}; valid: {', '.join(BROKER_FAULTS)}")

    def step() -> int:
        if window is None:
            return rng.randint(1, steps - 1)
        return rng.randint(1, window) if rng.random() < 0.5 else rng.randint(window + 1, steps - 1)

    if broker is not None:
        return [Kill(broker, step(), round(rng.uniform(0.0, 2.0), 2))]
    kind = rng.choice(["one", "one", "two", "twice"])
    first = rng.choice(stages)
    if kind == "one":
        names = [first]
    elif kind == "two":
        names = [first, rng.choice([s for s in stages if s != first])]
    else:
        names = [first, first]
    at = sorted(step() for _ in names)
    if kind == "twice" and at[0] == at[1]:  # the restarted process needs time to exist
        at = [at[0], at[0] + 1] if at[0] + 1 < steps else [at[0] - 1, at[0]]
        at = [max(1, a) for a in at]
    return [Kill(n, a, round(rng.uniform(0.0, 2.0), 2)) for n, a in zip(names, at)]


def _broker_fault(k: Kill, run_dir: Path, broker: BrokerHandle, result: ChaosResult) -> None:
    """Fire the broker fault ``k`` on the local Kafka ``broker`` (module docstring); a
    restart updates ``broker``'s node pids in place, so the caller stops the new nodes."""
    from relax.infra.broker.kafka import start_kafka

    if k.stage == BROKER_RESTART:
        t0 = time.monotonic()
        for pid in broker.pids:
            os.kill(pid, signal.SIGKILL)
        result.killed.append(f"{k.stage}@{k.after_step}+{k.delay_s}s")
        time.sleep(3.0)
        try:
            new = start_kafka(broker.data_dir)  # same log dirs, same ports
        except (OSError, TimeoutError) as e:  # kept in the result: a timer thread's is lost
            result.broker_error = repr(e)[:2000]
            return
        broker.pid, broker.nodes = new.pid, new.nodes
        result.broker_outage_s = round(time.monotonic() - t0, 1)
        return
    from kafka import KafkaAdminClient

    from relax.schemas import topics

    admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap.split(","))
    try:
        topic = topics.run_topic(result.run, topics.TRAIN_SAMPLES)
        parts = admin.describe_topics([topic])[0]["partitions"]
    finally:
        admin.close()
    leader = next(p["leader_id"] for p in parts if p["partition_index"] == 0)
    node = next(n for n in broker.nodes if n.node_id == leader)
    os.kill(node.pid, signal.SIGKILL)
    result.killed.append(f"{k.stage}@{k.after_step}+{k.delay_s}s(node {leader})")


def _killer(kills: list[Kill], result: ChaosResult, broker: BrokerHandle | None):
    """An ``on_step`` callback for :func:`train` that fires the planned kills."""
    pending = list(kills)
    timers: list[threading.Timer] = []

    def fire(k: Kill, run_dir: Path) -> None:
        stages = json.loads((run_dir / "stages.json").read_text())
        if k.stage in BROKER_FAULTS:
            if not stages.get("trainer", {}).get("finished"):
                _broker_fault(k, run_dir, broker, result)
            return
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
              also: Callable[[dict, Path], None] | None = None,
              broker: BrokerHandle | None = None) -> ChaosResult:
    """Run ``recipe`` with ``kills``; never raises for a run that fails (the error is in
    the result). ``also(step_row, run_dir)`` is called after each step's kills are
    planned (any other fault). ``broker``: the local Apache Kafka the recipe uses, for the
    broker faults in ``kills`` (:data:`BROKER_FAULTS`); after a :data:`BROKER_RESTART` it
    holds the restarted nodes' pids (stop it with :func:`relax.infra.broker.local.stop_broker`).
    Returns once every fault fired has ended (a restarted broker is ready).

    Raises:
        ValueError: a broker fault without a Kafka ``broker`` handle, or
            :data:`BROKER_NODE_LOST` on a cluster of fewer than 3 nodes.
    """
    from relax.infra.control.launch import RunFailed, train

    faults = [k.stage for k in kills if k.stage in BROKER_FAULTS]
    if faults and broker is None:
        raise ValueError(f"broker faults {faults} need the handle of the local Apache Kafka "
                         "the run uses (broker=), got None")
    if BROKER_NODE_LOST in faults and len(broker.nodes) < 3:
        raise ValueError(f"{BROKER_NODE_LOST} needs a 3-node Kafka cluster (replication "
                         f"factor 3), got {len(broker.nodes)} node(s)")
    result = ChaosResult(recipe.run, kills)
    kill_on_step, timers = _killer(kills, result, broker)

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
        for t in timers:  # a broker restart under way: the broker is back before we return
            t.join(180.0)
    result.wall_s = round(time.monotonic() - t0, 1)
    result.finished = s.get("steps") == recipe.trainer.steps
    for k in ("sampled", "trained", "stale", "filtered", "errors"):
        setattr(result, k, int(s.get(k, 0)))
    result.lost, result.trained_twice = lost_and_trained_twice(s)
    return result


def lost_and_trained_twice(summary: dict) -> tuple[int, int]:
    """``(lost, trained_twice)`` of a finished run (module docstring) from its summary
    (:func:`relax.infra.control.launch.train`'s) and its folder's ``metrics.jsonl``."""
    twice = _rows_trained(Path(summary["run_dir"])) - int(summary.get("trained", 0))
    return int(summary.get("unaccounted", 0)), max(0, twice)


def _rows_trained(run_dir: Path) -> int:
    """Rows the trainer's final steps trained (the latest record of each step)."""
    from relax.infra.observe.report import step_rows

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return int(sum(s.get(M.SAMPLES_TRAINED, 0) for s in step_rows(rows)))

"""Seeded chaos runs: stage processes SIGKILLed (or frozen with SIGSTOP) at random
moments of the tiny run on Apache Kafka. Every run must finish with every sampled rollout in exactly one ledger
bucket and none trained twice (``benchmarks/chaos.py`` runs many more of the same)."""

from __future__ import annotations

import json
import random
import signal
import uuid
from pathlib import Path

import pytest
from testdata import kill_when, tiny_recipe

from relax.infra.control.chaos import Kill, chaos_run, plan_kills

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]


def _assert_whole(r):
    detail = json.dumps(r.as_dict(), default=str)[:3000]
    assert r.finished, detail
    assert r.lost == 0 and r.trained_twice == 0, detail
    assert r.trained + r.stale + r.filtered + r.errors == r.sampled > 0, detail


def test_chaos_reward_and_aggregator_killed(broker, tmp_path):
    """The run of the 2026-12-01 CI failure (shared/evidence/chaos-hang-2026-12-01)."""
    recipe = tiny_recipe(broker, tmp_path, "chaos" + uuid.uuid4().hex[:6], "trainer.steps=5")
    r = chaos_run(recipe, [Kill("reward.parity", 1, 0.0), Kill("aggregate", 3, 0.0)], 500)
    assert len(r.killed) == 2, r.killed
    _assert_whole(r)


def test_rollout_killed_while_its_groups_wait_samples_nothing_extra(broker, tmp_path):
    """The kill of chaos run 23 (seed 0), which left 8 rollouts sampled and never decided
    before the successor counted its predecessor's groups in flight."""
    recipe = tiny_recipe(broker, tmp_path, "chaosro" + uuid.uuid4().hex[:4], "trainer.steps=5")
    r = chaos_run(recipe, [Kill("rollout-0", 1, 0.39)], 500)
    assert r.killed, r
    _assert_whole(r)


def test_a_trainer_without_checkpoints_killed_restarts_from_the_base_and_finishes_whole(
        broker, tmp_path):
    """``checkpoint_every: 0`` keeps no checkpoint until the end: a trainer killed after
    step 4 starts again from the base model at policy_version 0 and trains 10 steps. The
    dead trainer's snapshots (every 2 versions) are replaced, not loaded against the new
    announcements (a staleness run restarted so: its engine refused v10, "checksum differs
    from the announcement"); rollouts made by its weights are counted stale; the rollout
    stage, killed while the new trainer is under the dead one's newest version, loads the
    new trainer's weights."""
    recipe = tiny_recipe(broker, tmp_path, "nockpt" + uuid.uuid4().hex[:4], "trainer.steps=10",
                         "trainer.checkpoint_every=0", "trainer.weights_snapshot_every=2")
    r = chaos_run(recipe, [Kill("trainer", 4, 0.0), Kill("rollout-0", 4, 6.0)], 500)
    assert len(r.killed) == 2, r.killed
    _assert_whole(r)
    assert r.stale > 0, r.as_dict()  # the dead trainer's newer rollouts


# seed 11 found the lost leader rejoin of kafka-python (streams/kafka_join.py)
@pytest.mark.parametrize("seed", [3, 11])
def test_seeded_chaos_run(broker, tmp_path, seed):
    kills = plan_kills(random.Random(seed), 5)  # after steps 1-4, each up to 2 s late
    # 16 steps: a kill 2 s after step 4 still lands in a live run (a tiny step takes
    # 0.3-0.5 s on Kafka; with 8 steps one CI run ended 1.8 s after step 3, before its kill)
    recipe = tiny_recipe(broker, tmp_path, f"chaos{seed}" + uuid.uuid4().hex[:4],
                         "trainer.steps=16")
    r = chaos_run(recipe, kills, 500)
    assert r.killed, kills
    _assert_whole(r)


FAST_PARITY = 'rewards=[{name: parity, fn: "testdata:parity_reward", timeout_s: 5}]'
"""The parity reward with a call limit under the tests' 20 s stall limit."""


def _frozen_after_step_1(run_dir: Path, stage: str):
    """SIGSTOP ``stage`` (alive, holds its partitions, does nothing) as soon as the
    trainer's step-1 checkpoint is in place (``tiny_ci.yaml`` checkpoints every step).
    Then at most (1 + max_staleness + 1) x batch_groups groups have started, so the run
    cannot end without the frozen stage. Not on the driver's step-1 event: that comes
    seconds late, when a fast trainer may have sampled and scored every group."""
    return kill_when((run_dir / "checkpoints" / "step_000001").exists,
                     lambda: [json.loads((run_dir / "stages.json").read_text())[stage]["pid"]],
                     sig=signal.SIGSTOP)


def test_frozen_stage_is_noticed_and_restarted(broker, tmp_path):
    from relax.infra.control.launch import train

    run = "frozen" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "stall_timeout_s=20", FAST_PARITY,
                         "trainer.steps=5")
    lines: list[str] = []
    with _frozen_after_step_1(tmp_path / run, "reward.parity") as frozen:
        s = train(recipe, say=lines.append, timeout_s=400)
    assert frozen and s["steps"] == 5 and s["balanced"], json.dumps(s, default=str)
    assert any(ln.startswith("restarted reward.parity: ") for ln in lines), lines
    state = json.loads((Path(s["run_dir"]) / "stages.json").read_text())
    assert state["reward.parity"]["restarts"] == 1
    assert "stalled" in state["reward.parity"]["history"][0]


def test_frozen_stage_past_its_restarts_fails_the_run_with_a_report(broker, tmp_path):
    from relax.infra.control.launch import RunFailed, train

    # 8 steps (16 groups): when step 1's checkpoint is in place, the credit has let at most
    # consumed + (max_staleness + 1) x batch_groups groups start, so the run cannot end
    # without the frozen aggregator (with 3 steps it could: a CI flake, 2026-12-02)
    run = "frozenx" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "stall_timeout_s=20", FAST_PARITY,
                         "max_restarts=0", "trainer.steps=8")
    with _frozen_after_step_1(tmp_path / run, "aggregate") as frozen, \
            pytest.raises(RunFailed) as e:
        train(recipe, say=lambda _: None, timeout_s=300)
    assert frozen
    msg = str(e.value)
    assert "stage aggregate failed 1 times; last: stalled" in msg, msg
    stages, metrics = msg.split("latest metrics:")
    assert "aggregate (pid " in stages and "rollout-0 (pid " in stages, msg
    assert "trainer (" in metrics and "rollout-0 (" in metrics, msg  # every stage's counters


def test_local_broker_restart_stops_the_run_with_what_was_lost(tmp_path):
    """kill -9 of the broker and a restart on the same port without its data (a new
    folder: a cluster that lost its disks): the run stops within seconds, saying what was
    lost and how to go on (not a traceback)."""
    import time

    from relax.infra.broker.local import start_kafka, stop_broker
    from relax.infra.control.launch import RunFailed, train

    h = start_kafka(tmp_path / "kafka-a")
    handles = [h]

    def restart_broker():
        time.sleep(2)
        handles.append(start_kafka(tmp_path / "kafka-b", port=h.port))

    run = "lost" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(h.bootstrap, tmp_path, run, "trainer.steps=5")
    t0 = time.monotonic()
    try:  # killed once step 1's checkpoint is in place (steps 2-5 still to come)
        with kill_when((tmp_path / run / "checkpoints" / "step_000001").exists,
                       lambda: [h.pid], then=restart_broker) as killed, \
                pytest.raises(RunFailed) as e:
            train(recipe, say=lambda _: None, timeout_s=300)
    finally:
        for x in handles:
            stop_broker(x)
    assert len(killed) == 1 and len(handles) == 2, (killed, handles)
    msg = str(e.value)
    assert "lost its broker's state" in msg and "checkpoint" in msg, msg
    assert time.monotonic() - t0 < 120, msg  # 36 s on 2 cores (the stages get 5 s to stop)


def test_a_dead_local_broker_ends_the_run_at_once_with_how_to_go_on(tmp_path):
    """kill -9 of the run's own local broker, not restarted: the driver sees its process
    gone and ends the run at its next check, naming the folder its topics are kept in and
    the command to go on (it waited 120 s for an answer, and the stages restarted, before);
    that command goes on with the run."""
    import time

    from testdata import PARITY_REWARD, RECIPES

    from relax.infra.control.launch import RunFailed, train
    from relax.infra.recipe.recipe import load_recipe

    run = "dead" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / "tiny_ci.yaml", [f"run_root={tmp_path}", f"run={run}",
                                                    PARITY_REWARD, "trainer.steps=20"])
    assert not recipe.bootstrap_servers  # the run starts and owns its broker
    run_dir = tmp_path / run

    def broker_pid() -> list[int]:
        return [json.loads((run_dir / "driver.json").read_text())["broker"]["pid"]]

    killed_at: list[float] = []
    with kill_when((run_dir / "checkpoints" / "step_000001").exists, broker_pid,
                   then=lambda: killed_at.append(time.monotonic())) as killed, \
            pytest.raises(RunFailed) as e:
        train(recipe, say=lambda _: None, timeout_s=300)
    ended = time.monotonic()
    assert len(killed) == 1 and killed_at, killed
    msg = str(e.value)
    assert "lost its broker: the run's local broker" in msg and "is gone" in msg, msg
    assert f"kept in {run_dir / 'broker'}" in msg, msg
    assert f"relax train --resume {run_dir}" in msg, msg
    # 5 s checks + 5 s stop (36 s under a load of 30 on 2 cores); before, BROKER_GONE_S (120 s)
    assert ended - killed_at[0] < 90, (ended - killed_at[0], msg)


"""``relax train --resume RUN`` (``infra/control/resume.py``): a run whose driver was SIGKILLed
goes on from each stage's committed offsets and the trainer's newest checkpoint, and
ends with every sampled rollout in exactly one ledger bucket over both parts and none
trained twice (``relax.infra.control.chaos.lost_and_trained_twice``). The driver runs as a
``relax train`` subprocess on the test's broker (``--bootstrap``) so it can be killed;
a run that cannot go on is refused with one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from testdata import PARITY_REWARD, RECIPES

from relax.infra.broker.local import pid_alive
from relax.infra.control.chaos import lost_and_trained_twice

pytestmark = pytest.mark.e2e

CLI = [sys.executable, "-m", "relax.infra.cli.app", "train"]
EVAL = ('eval={source: "reasoning_gym:basic_arithmetic?size=40&seed=7&min_digits=1'
        '&max_digits=1", size: 4, max_new_tokens: 2, after: false, '
        'reward: {name: e, fn: "testdata:parity_reward"}}')
"""A held-out eval of 4 prompts, before training only (the resumed part reuses it)."""


def _start(run_dir: Path, *args: str) -> subprocess.Popen:
    """``relax train`` of the tiny recipe as run ``run_dir.name`` under ``run_dir.parent``,
    its output in ``run_dir.parent/<run>.part1.log``."""
    return subprocess.Popen(
        [*CLI, str(RECIPES / "tiny_ci.yaml"), f"run={run_dir.name}",
         f"run_root={run_dir.parent}", PARITY_REWARD, *args],
        stdout=(run_dir.parent / f"{run_dir.name}.part1.log").open("w"),
        stderr=subprocess.STDOUT, env=os.environ.copy())


def _kill_when(driver: subprocess.Popen, ready: Path, run_dir: Path, everything: bool,
               timeout_s: float = 400.0) -> list[int]:
    """SIGKILL the driver (and with ``everything`` every stage process in
    ``stages.json`` at the same moment) as soon as ``ready`` exists; the pids killed."""
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        log = (run_dir.parent / f"{run_dir.name}.part1.log").read_text()
        assert driver.poll() is None, f"the driver ended before {ready.name}:\n{log[-3000:]}"
        assert time.monotonic() < deadline, f"no {ready} in {timeout_s}s:\n{log[-3000:]}"
        time.sleep(0.02)
    pids = [driver.pid]
    if everything:
        pids += [s["pid"] for s in json.loads((run_dir / "stages.json").read_text()).values()]
    for p in pids:
        os.kill(p, signal.SIGKILL)
    driver.wait(30)
    return pids


def _resume(target: str, *args: str, timeout_s: float = 500,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``relax train --resume target *args`` run to its end."""
    return subprocess.run([*CLI, "--resume", target, *args], capture_output=True, text=True,
                          timeout=timeout_s, env=os.environ.copy(), cwd=cwd, check=False)


def _last_line_counts(stdout: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in stdout.strip().splitlines()[-1].split())}


@pytest.mark.parametrize(("moment", "ready", "everything", "not_yet", "more"), [
    # before the first step: the stages were just started, every process killed
    ("before-step-1", "stages.json", True, "checkpoints/step_000001", []),
    # mid-run after a checkpoint, the driver alone (its stages go on for seconds, then Ray
    # ends them); the resumed run also trains longer
    ("after-checkpoint-2", "checkpoints/step_000002", False, None, ["trainer.steps=6"]),
    # just before the last step: step 4's checkpoint of 5 in place, every process killed
    ("before-last-step", "checkpoints/step_000004", True, "checkpoints/step_000005", []),
])
def test_a_killed_driver_resumes_to_a_whole_run(broker, tmp_path, moment, ready, everything,
                                                not_yet, more):
    run_dir = tmp_path / f"res{uuid.uuid4().hex[:6]}"
    extra = [EVAL] if moment == "before-step-1" else []
    driver = _start(run_dir, "trainer.steps=5", *extra, "--bootstrap", broker)
    killed = _kill_when(driver, run_dir / ready, run_dir, everything)
    assert not (run_dir / "summary.json").exists()
    assert not_yet is None or not (run_dir / not_yet).exists()  # left to the resumed part
    # by the folder; the broker is the recipe's (--bootstrap was saved in recipe.yaml)
    r = _resume(str(run_dir), *more, "--timeout-s", "450")
    out = r.stdout + r.stderr
    (tmp_path / f"{run_dir.name}.part2.log").write_text(out)
    assert r.returncode == 0, out[-6000:]
    assert f"resume: {run_dir.name} in {run_dir}, the trainer from " in r.stdout, out[-3000:]
    assert not any(pid_alive(p) for p in killed)
    steps = 6 if more else 5
    f = _last_line_counts(r.stdout)
    assert f["steps"] == steps, out[-3000:]
    assert f["trained"] + f["stale"] + f["filtered"] + f["errors"] == f["sampled"] > 0, f
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["resumed"] and s["balanced"] and s["steps"] == steps, s
    assert lost_and_trained_twice(s) == (0, 0), s
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts[-1] == f"step_{steps:06d}", ckpts
    if moment == "before-step-1":  # measured once, by the killed driver
        before = json.loads((run_dir / "eval_before.json").read_text())
        assert s["eval_before"] == before and before["n"] == 4, s
        assert "measured before the driver died" in r.stdout, out[-3000:]
        part1 = (tmp_path / f"{run_dir.name}.part1.log").read_text()
        assert "eval before: greedy held-out accuracy" in part1, part1[-2000:]
    if moment == "before-last-step":  # done: refused as it is, trained on with more steps
        r = _resume(str(run_dir))
        assert r.returncode == 2 and "it finished its 5 steps" in r.stderr, r.stdout + r.stderr
        r = _resume(str(run_dir), "trainer.steps=6", "--timeout-s", "450")
        out = r.stdout + r.stderr
        assert r.returncode == 0, out[-6000:]
        assert "the trainer from its checkpoint at policy_version 5, 6 steps" in r.stdout, out
        s = json.loads((run_dir / "summary.json").read_text())
        assert s["steps"] == 6 and s["balanced"] and s["sampled"] > f["sampled"], s
        assert lost_and_trained_twice(s) == (0, 0), s


def test_the_local_broker_outlives_a_killed_driver_and_the_resumed_run_uses_it(tmp_path):
    """No --bootstrap: the driver's own Kafka runs in its own session, so SIGKILL of the
    driver alone leaves it, with the run's topics; the resumed run goes on there and
    stops it at its end."""
    (tmp_path / "runs").mkdir()
    run_dir = tmp_path / "runs" / f"loc{uuid.uuid4().hex[:6]}"
    driver = _start(run_dir, "trainer.steps=3")
    _kill_when(driver, run_dir / "checkpoints" / "step_000001", run_dir, everything=False)
    broker = json.loads((run_dir / "driver.json").read_text())["broker"]
    assert pid_alive(broker["pid"])
    r = _resume(run_dir.name, "--timeout-s", "450", cwd=tmp_path)  # by its name under runs/
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert (f"broker: the run's local broker at 127.0.0.1:{broker['port']} (pid "
            f"{broker['pid']}, data in {run_dir / 'broker'})") in r.stdout, out[-3000:]
    f = _last_line_counts(r.stdout)
    assert f["steps"] == 3 and f["trained"] + f["stale"] + f["filtered"] + f["errors"] \
        == f["sampled"] > 0, out[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["balanced"] and lost_and_trained_twice(s) == (0, 0), s
    assert not pid_alive(broker["pid"])  # the resumed driver stopped it


@pytest.mark.kafka
def test_every_process_killed_broker_included_resumes_from_the_run_folder(tmp_path):
    """No --bootstrap: the driver, its stages and the run's own Kafka SIGKILLed at once
    (a host's reboot); ``relax train --resume`` starts the broker again from the run
    folder (topics and committed offsets on disk) and the run goes on whole."""
    from relax.streams.ports import port_open

    run_dir = tmp_path / f"kaf{uuid.uuid4().hex[:6]}"
    driver = _start(run_dir, "trainer.steps=4")
    _kill_when(driver, run_dir / "checkpoints" / "step_000002", run_dir, everything=True)
    broker = json.loads((run_dir / "driver.json").read_text())["broker"]
    os.kill(broker["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while pid_alive(broker["pid"]) or port_open("127.0.0.1", broker["port"]):
        assert time.monotonic() < deadline, "the killed Kafka still holds its port"
        time.sleep(0.2)
    r = _resume(str(run_dir), "--timeout-s", "450")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert (f"resume: started the run's local broker again from {run_dir / 'broker'} at "
            f"127.0.0.1:{broker['port']}") in r.stdout, out[-3000:]
    f = _last_line_counts(r.stdout)
    assert f["steps"] == 4 and f["trained"] + f["stale"] + f["filtered"] + f["errors"] \
        == f["sampled"] > 0, out[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["balanced"] and lost_and_trained_twice(s) == (0, 0), s
    new = json.loads((run_dir / "driver.json").read_text())["broker"]
    assert not pid_alive(new["pid"])  # the resumed driver stopped it


def test_a_run_that_cannot_go_on_is_refused_in_one_line(tmp_path):
    """A run on its own local broker (no --bootstrap): refused while its driver runs,
    with a recipe change it cannot take, and once the driver, its stages and its broker
    were killed and the broker's folder (the run's topics) deleted."""
    run_dir = tmp_path / f"ref{uuid.uuid4().hex[:6]}"
    driver = _start(run_dir, "trainer.steps=5")
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "stages.json").exists():
            assert driver.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        r = _resume(str(run_dir))
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.startswith("error: cannot resume ") and "its driver (relax train, " \
            f"pid {driver.pid}) still runs" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    finally:
        broker = json.loads((run_dir / "driver.json").read_text())["broker"]
        _kill_when(driver, run_dir / "stages.json", run_dir, everything=True)
        os.kill(broker["pid"], signal.SIGKILL)
        shutil.rmtree(run_dir / "broker")
    r = _resume(str(run_dir), "rollout.group_size=8", "trainer.steps=9")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: cannot resume {run_dir}: the recipe changed "
                               "rollout.group_size (4 -> 8); a resumed run may change only "
                               "trainer.steps, "), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    r = _resume(str(run_dir), "trainer.steps=9")  # fine: but the topics are gone
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"error: cannot resume {run_dir}: its local broker (its folder "
                               f"{run_dir / 'broker'}) is gone, and with it every topic of "
                               "the run"), r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert not (run_dir / "summary.json").exists()

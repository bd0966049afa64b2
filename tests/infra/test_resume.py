"""What ``relax train --resume`` checks before a run goes on (``infra/control/resume.py``): which
recipe changes it takes, which run folder a name means, a finished run, steps below the
newest checkpoint, a driver still alive, and which leftover stage processes it stops.
(``tests/e2e/test_resume.py`` kills and resumes real runs.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import yaml
from testdata import tiny_recipe

from relax.infra.broker.local import pid_alive
from relax.infra.control.resume import (
    ResumeRefused,
    prepare_resume,
    process_started_at,
    recipe_changes,
    refused_changes,
    run_folder,
    stop_stage_orphans,
)


def _dump(*overrides: str) -> dict:
    return tiny_recipe("127.0.0.1:9", "/tmp/r", "r1", *overrides).model_dump(mode="json")


def test_steps_timeouts_and_the_address_may_change_the_model_and_group_size_may_not():
    changes = recipe_changes(_dump(), _dump("trainer.steps=30", "step_timeout_s=60",
                                            "bootstrap_servers=127.0.0.1:10",
                                            "telemetry.wandb=online"))
    assert set(changes) == {"trainer.steps", "step_timeout_s", "bootstrap_servers",
                            "telemetry.wandb"}
    assert changes["trainer.steps"] == (3, 30)
    assert refused_changes(changes) == {}
    bad = refused_changes(recipe_changes(_dump(), _dump(
        "rollout.group_size=8", "model=tiny-qwen", "trainer.steps=30",
        'rewards=[{name: other, fn: "testdata:parity_reward"}]')))
    assert {"rollout.group_size", "model", "trainer.model", "rewards"} <= set(bad)
    assert "trainer.steps" not in bad and bad["rollout.group_size"] == (4, 8)


def _run_folder(tmp_path, *overrides: str):
    """A run folder as ``relax train`` leaves it before its stages start."""
    recipe = tiny_recipe("127.0.0.1:9", tmp_path, "r1", *overrides)
    d = tmp_path / "r1"
    d.mkdir()
    (d / "recipe.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json"),
                                                  sort_keys=False))
    return d


def test_a_run_is_its_folder_or_its_name_under_runs(tmp_path, monkeypatch):
    d = _run_folder(tmp_path)
    assert run_folder(str(d)) == d.resolve()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    d.rename(tmp_path / "runs" / "r1")
    assert run_folder("r1") == (tmp_path / "runs" / "r1").resolve()
    with pytest.raises(ResumeRefused, match=r"^r2: no run there \(no r2/recipe.yaml nor "
                                            r"runs/r2/recipe.yaml\)"):
        run_folder("r2")


def test_a_finished_run_steps_below_its_checkpoint_and_a_live_driver_are_refused(tmp_path):
    d = _run_folder(tmp_path, "trainer.steps=5")
    (d / "checkpoints" / "step_000004").mkdir(parents=True)
    (d / "checkpoints" / "step_000004" / "trainer_state.json").write_text("{}")
    with pytest.raises(ResumeRefused, match=r"trainer.steps=3 is below its newest "
                                            r"checkpoint's policy_version 4$"):
        prepare_resume(str(d), ["trainer.steps=3"], say=lambda _: None)
    (d / "summary.json").write_text(json.dumps({"steps": 5}))
    with pytest.raises(ResumeRefused, match=r"it finished its 5 steps .*raise trainer.steps"):
        prepare_resume(str(d), [], say=lambda _: None)
    (d / "summary.json").unlink()
    (d / "driver.json").write_text(json.dumps({"pid": os.getpid(), "started_at": time.time(),
                                               "broker": None}))
    with pytest.raises(ResumeRefused, match=rf"its driver \(relax train, pid {os.getpid()}\) "
                                            r"still runs"):
        prepare_resume(str(d), [], say=lambda _: None)
    # the same pid recorded before this process started: another process, long gone
    (d / "driver.json").write_text(json.dumps({"pid": os.getpid(), "started_at": 1.0,
                                               "broker": None}))
    lines: list[str] = []
    recipe, resumed = prepare_resume(str(d), ["trainer.steps=6"], say=lines.append)
    assert recipe.trainer.steps == 6 and recipe.run_root == str(tmp_path.resolve())
    assert resumed.broker is None and resumed.eval_before is None  # no stages yet: no check
    assert lines == [(f"resume: r1 in {d.resolve()}, the trainer from its checkpoint at "
                      "policy_version 4, 6 steps in all")], lines


def _sleeper(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])


def test_only_the_stage_processes_of_the_dead_driver_are_stopped(tmp_path):
    procs = [_sleeper("ray::StageActor"), _sleeper("not-a-stage")]
    try:
        time.sleep(2.5)
        procs.append(_sleeper("ray::StageActor"))  # started after the file: a reused pid
        stage, other, later = procs
        path = tmp_path / "stages.json"
        path.write_text(json.dumps({
            "trainer": {"pid": stage.pid}, "aggregate": {"pid": other.pid},
            "reward.parity": {"pid": later.pid}, "rollout-0": {"pid": 2 ** 22 + 1}}))
        written = process_started_at(later.pid) - 1.5
        os.utime(path, (written, written))
        assert process_started_at(stage.pid) < written < time.time()
        assert process_started_at(2 ** 22 + 1) is None  # no such process
        assert stop_stage_orphans(tmp_path, wait_s=5) == {"trainer": stage.pid}
        stage.wait(10)
        assert not pid_alive(stage.pid) and pid_alive(other.pid) and pid_alive(later.pid)
    finally:
        for p in procs:
            p.kill()
            p.wait()

"""``relax train --resume RUN`` (``infra/control/resume.py``): a run whose driver was SIGKILLed
goes on from each stage's committed offsets and the trainer's newest checkpoint, and
ends with every sampled rollout in exactly one ledger bucket over both parts and none
trained twice (``relax.infra.control.chaos.lost_and_trained_twice``). The driver runs as a
``relax train`` subprocess on the test's broker (``--bootstrap``) so it can be killed;
a run that cannot go on is refused with one line and exit 2."""

from __future__ import annotations

import json
import uuid

import pytest
from resumerun import EVAL
from resumerun import kill_when as _kill_when
from resumerun import last_line_counts as _last_line_counts
from resumerun import resume as _resume
from resumerun import start as _start

from relax.infra.broker.local import pid_alive
from relax.infra.control.chaos import lost_and_trained_twice

pytestmark = pytest.mark.e2e

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

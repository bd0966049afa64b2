"""``relax train --resume RUN`` with the run's own local broker (split from
``test_resume.py`` so that the two files run on two pytest workers): the broker outlives a
killed driver, a run whose every process was killed (broker included) goes on from its
folder, and a run that cannot go on is refused with one line and exit 2."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid

import pytest
from resumerun import kill_when as _kill_when
from resumerun import last_line_counts as _last_line_counts
from resumerun import resume as _resume
from resumerun import start as _start

from relax.infra.broker.local import pid_alive
from relax.infra.control.chaos import lost_and_trained_twice

pytestmark = pytest.mark.e2e


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

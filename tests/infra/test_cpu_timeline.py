"""The run's CPU timeline (infra/cpu_timeline.py): real processes, read from /proc."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax.infra.cpu_timeline import (CpuTimeline, cpu_seconds, descendants, plot_timeline,
                                      read_timeline, run_processes)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def test_a_busy_process_shows_one_core_and_an_idle_one_none(tmp_path):
    """A process spinning in Python uses ~1 core with 1 busy thread; a sleeping one ~0; a
    process that ended is left out; the PNG is drawn with the step ends."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "cpu_timeline.jsonl"
    try:
        with CpuTimeline(path, lambda: {"busy": busy.pid, "idle": idle.pid, "gone": gone.pid},
                         interval_s=0.2):
            time.sleep(1.5)
    finally:
        busy.kill()
        idle.kill()
    rows = read_timeline(path)
    mine = {n: [r for r in rows if r["name"] == n] for n in ("busy", "idle", "gone")}
    assert len(mine["busy"]) >= 4 and not mine["gone"]
    # the first interval may include the interpreter's start; on a loaded machine one
    # interval of 0.2 s may give the spinning process less than half a core, not the mean
    steady = mine["busy"][1:]
    assert sum(r["cores"] for r in steady) / len(steady) > 0.7, steady
    assert all(r["threads"] == 1 for r in steady)
    assert max(r["cores"] for r in mine["idle"][1:]) < 0.1
    assert all(r["threads"] == 0 for r in mine["idle"])
    png = tmp_path / "timeline.png"
    assert plot_timeline(rows, png, [rows[0]["ts"] + 0.5])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_timeline([], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_cpu_seconds_of_this_process_and_of_no_process():
    """The process's figure also counts threads that have ended (a long test session has
    many), so its live threads' sum is at most that."""
    total, threads = cpu_seconds(__import__("os").getpid())
    assert total > 0 and threads and sum(threads.values()) <= total + 0.05
    assert cpu_seconds(2 ** 22 + 12345) is None  # above Linux's pid_max default
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        CpuTimeline("x", dict, interval_s=0)


def test_a_run_follows_its_stages_the_broker_itself_and_what_it_started(tmp_path):
    """A child Python program and the process it starts are found below this process,
    named by script and by command; a run's list names its stages and broker as given,
    this process ``driver``, and each of the others once."""
    import os

    script = tmp_path / "parent_prog.py"
    script.write_text("import subprocess, sys, time\n"
                      "subprocess.Popen(['sleep', '60'])\n"
                      "sys.stdout.write('ok\\n'); sys.stdout.flush(); time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ok\n"  # its own child has started
        grandchild = descendants(child.pid)
        assert list(grandchild) == ["sleep"], grandchild
        below = descendants(os.getpid())
        assert below["parent_prog"] == child.pid
        assert grandchild["sleep"] in below.values()
        pids = run_processes({"broker": 1}, lambda: {"stage": child.pid}, rescan_s=60)()
        assert pids["driver"] == os.getpid() and pids["broker"] == 1
        assert pids["stage"] == child.pid and "parent_prog" not in pids  # named once
        assert grandchild["sleep"] in pids.values()
    finally:
        for p in descendants(child.pid).values():
            os.kill(p, 9)
        child.kill()
        child.wait()


def test_processes_that_barely_ran_share_one_panel_their_sum():
    from relax.infra.cpu_timeline import SMALL_CORES, _small_ones_summed

    rows = [{"ts": t, "name": n, "cores": c} for t in (1.0, 2.0)
            for n, c in (("trainer", 1.8), ("raylet", 0.004), ("gcs_server", 0.006))]
    out = _small_ones_summed(rows)
    assert [r for r in out if r["name"] == "trainer"] == rows[0:1] + rows[3:4]
    assert [(r["ts"], round(r["cores"], 6)) for r in out if r["name"] == "other (2)"] == [
        (1.0, 0.01), (2.0, 0.01)]
    one_small = [r for r in rows if r["name"] != "raylet"]  # a lone small one keeps its name
    assert _small_ones_summed(one_small) == one_small and 0.006 < SMALL_CORES


def test_a_process_that_wakes_up_gets_its_busy_thread_counted(tmp_path):
    """Threads are read only while a process is busy: one that sleeps, then spins, shows
    its one busy thread from its second busy interval on (the first may count 0)."""
    p = subprocess.Popen([sys.executable, "-c",
                          "import time; time.sleep(1.0)\nwhile True: pass"])
    path = tmp_path / "cpu_timeline.jsonl"
    try:
        with CpuTimeline(path, lambda: {"p": p.pid}, interval_s=0.2):
            time.sleep(2.6)
    finally:
        p.kill()
    rows = read_timeline(path)
    idle = [r for r in rows if r["cores"] < 0.1]
    busy = [r for r in rows if r["cores"] > 0.5]
    assert len(idle) >= 2 and all(r["threads"] == 0 for r in idle), rows
    assert len(busy) >= 4 and all(r["threads"] == 1 for r in busy[1:]), rows

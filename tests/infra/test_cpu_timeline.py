"""The run's CPU timeline (infra/observe/cpu_timeline.py): real processes, read from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax.infra.observe.cpu_timeline import (BUSY, CpuTimeline, cpu_seconds, descendants,
                                      plot_timeline, read_timeline, run_processes)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


def _complete_rows(path: Path) -> list[dict]:
    """The rows written so far (a line still being written is left out)."""
    text = path.read_text() if path.exists() else ""
    return [json.loads(s) for s in text.splitlines(keepends=True) if s.endswith("\n")]


def _sample_until(path: Path, pids, enough, timeout_s: float = 30.0) -> list[dict]:
    """Sample ``pids`` every 0.2 s until ``enough(rows)`` or ``timeout_s``. The pytest
    workers share the two cores, so a spinning process may get a fraction of one: the
    test waits for the intervals it checks instead of sampling for a fixed time."""
    deadline = time.monotonic() + timeout_s
    with CpuTimeline(path, pids, interval_s=0.2):
        while not enough(_complete_rows(path)) and time.monotonic() < deadline:
            time.sleep(0.2)
    return read_timeline(path)


MARGIN = 0.02
"""Rows this close to :data:`BUSY` are not checked: a process's total and its threads
are read a moment apart."""


def _threads_checked(rows: list[dict]) -> int:
    """Asserts the rule for a one-thread process: after an interval of at least
    :data:`BUSY` cores (so its threads were read then too), its thread counts as busy
    exactly when the process used more than ``BUSY`` cores; returns how many rows the rule
    decided with the thread busy."""
    checked = 0
    for prev, row in zip(rows, rows[1:]):
        assert row["threads"] in (0, 1), row
        if prev["cores"] >= BUSY + MARGIN and abs(row["cores"] - BUSY) > MARGIN:
            assert row["threads"] == int(row["cores"] > BUSY), (prev, row)
            checked += row["threads"]
    return checked


def test_a_busy_process_shows_its_cpu_time_and_an_idle_one_none(tmp_path):
    """A process spinning in Python: the timeline's core-seconds are its CPU time as the
    kernel counts it at its end (``wait4``), less only what it spent outside the sampled
    intervals; its one thread is busy whenever it had more than BUSY cores. A sleeping
    one has ~0 cores and no busy thread; a process that ended is left out; the PNG is
    drawn with the step ends."""
    t0 = time.time()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    path = tmp_path / "cpu_timeline.jsonl"

    def enough(rows):
        mine = [r for r in rows if r["name"] == "busy"]
        return len(mine) >= 6 and _threads_checked(mine) >= 3

    try:
        rows = _sample_until(path, lambda: {"busy": busy.pid, "idle": idle.pid,
                                            "gone": gone.pid}, enough)
    finally:
        busy.kill()
        _, status, usage = os.wait4(busy.pid, 0)  # its CPU time, as the kernel counts it
        busy.returncode = os.waitstatus_to_exitcode(status)
        t1 = time.time()
        idle.kill()
        idle.wait()
    mine = {n: [r for r in rows if r["name"] == n] for n in ("busy", "idle", "gone")}
    assert enough(mine["busy"]) and not mine["gone"], mine["busy"]
    b = mine["busy"]
    seen = sum(r["cores"] * (r["ts"] - q["ts"]) for q, r in zip(b, b[1:]))
    cpu = usage.ru_utime + usage.ru_stime
    outside = (t1 - t0) - (b[-1]["ts"] - b[0]["ts"])  # one thread: at most one core
    assert cpu - outside - 0.05 <= seen <= cpu + 0.05, (seen, cpu, outside)
    assert max(r["cores"] for r in mine["idle"][1:]) < 0.1
    assert all(r["threads"] == 0 for r in mine["idle"])
    png = tmp_path / "timeline.png"
    assert plot_timeline(rows, png, [rows[0]["ts"] + 0.5])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_timeline([], tmp_path / "none.png") and not (tmp_path / "none.png").exists()


def test_cpu_seconds_of_this_process_and_of_no_process():
    """The process's figure also counts threads that have ended (a long test session has
    many), so its live threads' sum is at most that."""
    total, threads = cpu_seconds(os.getpid())
    assert total > 0 and threads and sum(threads.values()) <= total + 0.05
    assert cpu_seconds(2 ** 22 + 12345) is None  # above Linux's pid_max default
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        CpuTimeline("x", dict, interval_s=0)


def test_a_run_follows_its_stages_the_broker_itself_and_what_it_started(tmp_path):
    """A child Python program and the process it starts are found below this process,
    named by script and by command; a run's list names its stages and broker as given,
    this process ``driver``, and each of the others once."""
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
        child.stdout.close()


def test_processes_that_barely_ran_share_one_panel_their_sum():
    from relax.infra.observe.cpu_timeline import SMALL_CORES, _small_ones_summed

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
    no busy thread while it sleeps and its one busy thread once it has been busy for an
    interval (the first busy interval may count 0)."""
    p = subprocess.Popen([sys.executable, "-c",
                          "import time; time.sleep(1.5)\nwhile True: pass"])
    path = tmp_path / "cpu_timeline.jsonl"
    try:
        rows = _sample_until(path, lambda: {"p": p.pid}, lambda rows: _threads_checked(rows) >= 3)
    finally:
        p.kill()
        p.wait()
    idle = [r for r in rows if r["cores"] < 0.1]
    assert len(idle) >= 2 and all(r["threads"] == 0 for r in idle), rows
    first_busy = next(i for i, r in enumerate(rows) if r["threads"] == 1)
    assert any(r["cores"] < 0.1 for r in rows[:first_busy]), rows  # it slept first
    assert _threads_checked(rows) >= 3, rows


def test_the_peak_resident_set_of_each_process_is_kept(tmp_path):
    """A process that touches 200 MB and frees them: its peak (VmHWM) stays, this
    process's too; a pid that is gone adds nothing."""
    code = ("import time; b = bytearray(200_000_000); b[::4096] = b'x' * len(b[::4096]); "
            "del b; time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        timeline = CpuTimeline(tmp_path / "t.jsonl", lambda: {"hog": child.pid, "me": os.getpid(),
                                                             "gone": 2 ** 22 + 7})
        while time.monotonic() < deadline:
            timeline.sample()
            if timeline.peak_rss_mb().get("hog", 0) >= 200:
                break
            time.sleep(0.2)
        peaks = timeline.peak_rss_mb()
        assert 200 <= peaks["hog"] < 400, peaks
        assert peaks["me"] > 10 and "gone" not in peaks, peaks
        assert list(peaks) == sorted(peaks, key=lambda n: -peaks[n])
    finally:
        child.kill()
        child.wait()

"""Where the cores went during a run: the CPU use of every process of the run on this
host (the stages, the broker, the driver, Ray's daemons: :func:`run_processes`), sampled
from ``/proc``, written to the run folder and drawn as a PNG.

:class:`CpuTimeline` runs a daemon thread in the driver that reads, every
``interval_s``, the CPU time (user + system, all threads: ``/proc/<pid>/stat`` fields 14
and 15) of each process ``pids()`` names, and appends one JSON line per process and
interval to ``<run>/cpu_timeline.jsonl``::

    {"ts": 1764770000.5, "name": "trainer", "pid": 123, "cores": 1.84, "threads": 2}

``cores`` is CPU seconds over wall seconds of the interval (2.0 = two cores busy the
whole time); ``threads`` counts the process's threads that ran for more than a quarter
of the interval (how many cores it really used at once). :func:`plot_timeline` draws a
row per process with the trainer's step ends as vertical lines (``timeline.png``):
a stage's busy and idle intervals, and who waits for whom, at a glance.

Each sample also reads every followed process's peak resident set (``VmHWM`` of
``/proc/<pid>/status``, exact between samples): :meth:`CpuTimeline.peak_rss_mb` gives
each name's largest, what a run's ``summary.json`` records as ``peak_rss_mb``.

Linux only (``/proc``); elsewhere, or for stages on other hosts, nothing is sampled.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_seconds(path: str) -> float | None:
    """utime + stime (seconds) from a ``/proc/.../stat`` file; None if it is gone."""
    try:
        with open(path) as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return (int(fields[11]) + int(fields[12])) / _TICK


def cpu_seconds(pid: int) -> tuple[float, dict[int, float]] | None:
    """``(process CPU seconds, {thread id: CPU seconds})`` of a live process, None when it
    is gone (or there is no ``/proc``)."""
    total = _stat_seconds(f"/proc/{pid}/stat")
    threads = None if total is None else thread_seconds(pid)
    return None if threads is None else (total, threads)


def thread_seconds(pid: int) -> dict[int, float] | None:
    """``{thread id: CPU seconds}`` of a live process, None when it is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return None
    threads = {}
    for tid in tids:
        s = _stat_seconds(f"/proc/{pid}/task/{tid}/stat")
        if s is not None:
            threads[int(tid)] = s
    return threads


def peak_rss_bytes(pid: int) -> int | None:
    """The process's peak resident set (``VmHWM``, bytes); None when it is gone (or has
    no memory of its own: a kernel thread)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


BUSY = 0.25
"""A thread is busy in an interval when it ran for more than this share of it."""


class CpuTimeline:
    """Samples the processes ``pids()`` returns (name -> pid) every ``interval_s`` into
    ``path`` (see the module docstring); ``start()`` / ``close()``, or a ``with`` block.

    Args:
        path: the JSON-lines file (appended to).
        pids: called at every sample: the processes to follow now (restarted stages
            get their new pid).
        interval_s: seconds between samples (> 0).

    Raises:
        ValueError: ``interval_s <= 0``.
    """

    def __init__(self, path: str | Path, pids: Callable[[], dict[str, int]],
                 interval_s: float = 0.5):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.path, self.pids, self.interval_s = Path(path), pids, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="cpu-timeline", daemon=True)
        self._last: dict[int, tuple] = {}
        self._peak: dict[str, int] = {}  # name -> largest VmHWM seen (bytes)

    def start(self) -> CpuTimeline:
        """Start sampling (returns self)."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop sampling (the last interval is written)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def peak_rss_mb(self) -> dict[str, float]:
        """``{name: MB}``: each followed process's peak resident set seen so far (its
        ``VmHWM``; a restarted stage's largest over its processes), in MB (10^6 bytes),
        largest first. RSS counts shared pages (libraries, ``/dev/shm`` buffers) in every
        process that maps them, so the sum over names is an upper bound of the run's."""
        return {n: round(b / 1e6, 1)
                for n, b in sorted(self._peak.items(), key=lambda x: -x[1])}

    def __enter__(self) -> CpuTimeline:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def sample(self) -> list[dict]:
        """One sample: a row per followed process seen at the previous sample too. A
        process's threads are read only while it uses at least :data:`BUSY` cores (an
        idle one has no busy thread; a relax run follows ~15 processes of 10-45
        threads each, and reading every thread each second cost 13 ms a sample). So
        the first busy interval after idle ones counts its threads over the time since
        they were last read, and may count fewer."""
        now = time.time()
        rows = []
        for name, pid in self.pids().items():
            total = _stat_seconds(f"/proc/{pid}/stat")
            peak = peak_rss_bytes(pid) if total is not None else None
            if peak is not None:
                self._peak[name] = max(self._peak.get(name, 0), peak)
            prev = self._last.get(pid)
            hot = prev is None or (now > prev[0]
                                   and (total or 0) - prev[1] >= BUSY * (now - prev[0]))
            threads = thread_seconds(pid) if hot and total is not None else None
            if total is None or (hot and threads is None):
                self._last.pop(pid, None)
                continue
            # (time, total, time of the threads' reading, the threads' seconds then)
            self._last[pid] = (now, total, *((now, threads) if hot else prev[2:]))
            if prev is None or now <= prev[0]:
                continue
            dt = now - prev[0]
            busy = 0
            if hot and now > prev[2]:  # thread rates since their last reading
                span = now - prev[2]
                busy = sum(1 for tid, sec in threads.items()
                           if sec - prev[3].get(tid, sec) > BUSY * span)
            rows.append({"ts": round(now, 3), "name": name, "pid": pid,
                         "cores": round((total - prev[1]) / dt, 3), "threads": busy})
        return rows

    def _loop(self) -> None:
        with self.path.open("a") as f:
            while True:
                for row in self.sample():
                    f.write(json.dumps(row) + "\n")
                f.flush()
                if self._stop.wait(self.interval_s):
                    return


def descendants(pid: int) -> dict[str, int]:
    """name -> pid of every process below ``pid`` (its children, theirs, ...), read from
    ``/proc``: a relax driver's are Ray's daemons (``gcs_server``, ``raylet``,
    ``log_monitor``), its idle workers and the stage processes. A name is the process's
    command (``comm``), or for a Python program its script's file name without ``.py``;
    where names repeat, ``#<pid>`` is added. Empty without ``/proc``."""
    try:
        entries = [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except FileNotFoundError:
        return {}
    children: dict[int, list[int]] = {}
    for p in entries:
        try:
            with open(f"/proc/{p}/stat") as f:
                stat = f.read()
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(p)
    below, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        below.append(p)
        todo.extend(children.get(p, []))
    out: dict[str, int] = {}
    for p in sorted(below):
        name = _process_name(p)
        if name is not None:
            out[f"{name}#{p}" if name in out else name] = p
    return out


def run_processes(fixed: dict[str, int], stages: Callable[[], dict[str, int]],
                  rescan_s: float = 10.0) -> Callable[[], dict[str, int]]:
    """The ``pids`` of a run's :class:`CpuTimeline`: ``fixed`` (the broker), the stages
    ``stages()`` names, this process as ``driver``, and the rest of its
    :func:`descendants` (Ray's daemons and idle workers; looked up again every
    ``rescan_s`` seconds, a scan of ``/proc`` costing a few ms)."""
    me = os.getpid()
    seen: dict = {"at": float("-inf"), "below": {}}

    def pids() -> dict[str, int]:
        now = time.monotonic()
        if now - seen["at"] >= rescan_s:
            seen["at"], seen["below"] = now, descendants(me)
        named = {**fixed, **stages()}
        taken = set(named.values())
        return {"driver": me, **{n: p for n, p in seen["below"].items() if p not in taken},
                **named}

    return pids


def _process_name(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return None
    script = next((a for a in argv[1:3] if a.endswith(".py")), None)
    return Path(script).stem if comm.startswith("python") and script else comm


def read_timeline(path: str | Path) -> list[dict]:
    """The rows of a ``cpu_timeline.jsonl`` (empty list when there is none)."""
    p = Path(path)
    if not p.is_file():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


SMALL_CORES = 0.02
"""A process under this many cores on average is drawn in the ``other`` panel."""


def _small_ones_summed(rows: list[dict]) -> list[dict]:
    """``rows`` with the processes under :data:`SMALL_CORES` on average replaced by one
    ``other (n)`` row per sample (a sample's rows share their ``ts``)."""
    per: dict[str, list[float]] = {}
    for r in rows:
        per.setdefault(r["name"], []).append(r["cores"])
    small = {n for n, v in per.items() if sum(v) / len(v) < SMALL_CORES}
    if len(small) < 2:
        return rows
    other: dict[float, float] = {}
    for r in rows:
        if r["name"] in small:
            other[r["ts"]] = other.get(r["ts"], 0.0) + r["cores"]
    name = f"other ({len(small)})"
    return ([r for r in rows if r["name"] not in small]
            + [{"ts": t, "name": name, "cores": c} for t, c in sorted(other.items())])


def plot_timeline(rows: list[dict], png: str | Path, step_ends: list[float] = (),
                  cores: int | None = None) -> bool:
    """Draw ``rows`` (:func:`read_timeline`) as one panel per process, CPU cores used
    over seconds since the first sample, with dashed lines at ``step_ends`` (UNIX
    seconds: the trainer's step ends); processes that used under :data:`SMALL_CORES` on
    average share one panel, ``other (n)``, their sum. Returns False (no file) when
    there are no rows.

    Args:
        cores: the machine's cores (the panels' upper limit; default ``os.cpu_count()``).
    """
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["ts"] for r in rows)
    rows = _small_ones_summed(rows)
    names = sorted({r["name"] for r in rows},
                   key=lambda n: -sum(r["cores"] for r in rows if r["name"] == n))
    top = cores or os.cpu_count() or 1
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.1 + 0.9 * len(names)), sharex=True,
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        mine = [r for r in rows if r["name"] == name]
        xs = [r["ts"] - t0 for r in mine]
        ax.fill_between(xs, [r["cores"] for r in mine], step="pre", alpha=0.7)
        ax.set_ylim(0, top * 1.05)
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
        for t in step_ends:
            ax.axvline(t - t0, color="grey", lw=0.6, ls="--")
    axes[-1, 0].set_xlabel("seconds (dashed: trainer step ends); y: CPU cores in use")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return True


__all__ = ["CpuTimeline", "cpu_seconds", "descendants", "plot_timeline", "read_timeline",
           "thread_seconds"]

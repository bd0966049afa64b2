"""Which threads of a live run use the cores while one of its processes computes.

    python benchmarks/thread_cores.py DRIVER_PID [--windows 4] [--seconds 8] [--busy 1.5]
                                      [--json OUT]

``DRIVER_PID`` is the ``relax train`` process (or any process that started the run
in-process, such as ``e2e_vs_trl.py --one sync``). Its processes are it and everything
below it (:func:`relax.infra.cpu_timeline.descendants`: the stages, the broker, Ray's
daemons). Each second the tool looks for one using ``--busy`` cores or more (1.5: the
trainer training, the rollout generating at two threads; 0.9 for relax async's one-thread
stages); then, over ``--seconds``, it reads every thread's CPU seconds and wake-ups
(voluntary context switches: each time a thread went to sleep and was woken again) from
``/proc`` and gives, per process, its cores, its wake-ups a second and its busiest and
most wakeful threads. The run's CPU timeline reads threads only of busy processes; this
shows what the idle ones spend their cores on (their Kafka clients' I/O threads, the stage
loop, Ray's threads).
Threads are named by ``py-spy dump`` where ``py-spy`` is installed (Python's thread
names: ``kafka-io-relax-<client>``, ``relax-trainer-input``; not a relax dependency),
else by their ``comm``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BUSY_CORES = 1.5


def _python_names(pid: int) -> dict[int, str]:
    """``{thread id: Python thread name}`` from ``py-spy dump`` (empty without it)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(exe).exists():
        return {}
    out = subprocess.run([exe, "dump", "-p", str(pid)], capture_output=True, text=True,
                         timeout=30).stdout
    names = {}
    for line in out.splitlines():  # Thread 1234 (idle): "MainThread"
        parts = line.split(maxsplit=2)
        if len(parts) == 3 and parts[0] == "Thread" and parts[1].isdigit():
            names[int(parts[1])] = parts[2].split(":", 1)[-1].strip().strip('"')
    return names


def _comm(pid: int, tid: int) -> str:
    try:
        return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
    except OSError:
        return str(tid)


def thread_wakeups(pid: int) -> dict[int, int]:
    """``{thread id: voluntary context switches so far}`` of a live process (empty when
    it is gone)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out[int(tid)] = next(int(line.split()[1]) for line in f
                                     if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def window(procs: dict[str, int], seconds: float, names: dict) -> dict:
    """Per process ``{"cores", "wakeups_per_s", "threads": [[name, cores], ...],
    "wakeful": [[name, wake-ups a second], ...]}`` over ``seconds``."""
    from relax.infra.cpu_timeline import thread_seconds

    before = {n: thread_seconds(p) or {} for n, p in procs.items()}
    woke = {n: thread_wakeups(p) for n, p in procs.items()}
    time.sleep(seconds)
    out = {}
    for n, p in procs.items():
        after = thread_seconds(p) or {}
        used = {t: after[t] - before[n].get(t, after[t]) for t in after}
        wakes = {t: w - woke[n].get(t, w) for t, w in thread_wakeups(p).items()}
        if p not in names:
            names[p] = _python_names(p)
        top = sorted(used.items(), key=lambda kv: -kv[1])[:8]
        often = sorted(wakes.items(), key=lambda kv: -kv[1])[:8]
        out[n] = {"cores": round(sum(used.values()) / seconds, 4),
                  "wakeups_per_s": round(sum(wakes.values()) / seconds, 1),
                  "threads": [[names[p].get(t) or _comm(p, t), round(c / seconds, 4)]
                              for t, c in top if c > 0],
                  "wakeful": [[names[p].get(t) or _comm(p, t), round(w / seconds, 1)]
                              for t, w in often if w > 0]}
    return out


def main() -> None:
    from relax.infra.cpu_timeline import cpu_seconds, descendants

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("driver", type=int)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--busy", type=float, default=BUSY_CORES,
                    help="cores a process must use to count as computing")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    names: dict = {}
    res = []
    while len(res) < a.windows and Path(f"/proc/{a.driver}").exists():
        procs = {"driver": a.driver, **descendants(a.driver)}
        c0 = {n: cpu_seconds(p) for n, p in procs.items()}
        time.sleep(1.0)
        c1 = {n: cpu_seconds(p) for n, p in procs.items()}
        busy = [n for n in procs if c0[n] and c1[n] and c1[n][0] - c0[n][0] >= a.busy]
        if not busy:
            continue
        w = {"at": time.strftime("%H:%M:%S"), "busy": busy,
             "processes": window(procs, a.seconds, names)}
        res.append(w)
        print(f"== {w['at']} busy: {', '.join(busy)}", flush=True)
        for n, r in sorted(w["processes"].items(), key=lambda kv: -kv[1]["cores"]):
            if r["cores"] >= 0.005 or r["wakeups_per_s"] >= 20:
                top = ", ".join(f"{t} {c}" for t, c in r["threads"][:6])
                often = ", ".join(f"{t} {c}" for t, c in r["wakeful"][:4])
                print(f"  {n:18s} {r['cores']:.4f}  {top}\n  {'':18s} "
                      f"{r['wakeups_per_s']:7.1f}/s  {often}", flush=True)
        wakes = sum(r["wakeups_per_s"] for n, r in w["processes"].items() if n not in busy)
        print(f"  wake-ups of the processes not computing: {wakes:.0f}/s", flush=True)
        time.sleep(a.seconds)  # the next window a little later in the run
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

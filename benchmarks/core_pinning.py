"""relax async with the trainer on a core of its own: does keeping the waiting processes
off the bottleneck's core pay? (issue 19)

While the trainer trains, the run's other processes (the driver, the broker, Ray's
daemons, the reward and aggregate stages) take ~0.17 of the 2 cores in short wake-ups,
and the kernel puts them on either core. Here a sidecar thread, every 0.5 s, pins every
thread of the trainer stage to core 0 and every thread of every other process of the run
(the rollout stage included) to core 1 (``sched_setaffinity``), so the trainer never
shares its core and the rollout takes all of the waiting processes' work.

Each round runs ``e2e_vs_trl.py --one SYSTEM`` (1 torch thread per stage) twice, left
alone then pinned, and summarises both with ``e2e_vs_trl.summarise`` (steady samples/s,
the trainer's ms a row, its data-wait, the rollout's idle share). ``--plan compute`` pins
only the two computing stages (trainer core 0, rollout core 1) and leaves the waiting
processes to the kernel. ``--system sync1t --plan sync`` puts relax sync's two stages,
which take turns, on core 0 and everything else on core 1: a core of their own for the
waiting processes, none of them on the computing one. Linux only; the pinned runs need
``sched_setaffinity`` on other processes of the same user.

    python benchmarks/core_pinning.py --system async2 --steps 12 --rounds 2
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import e2e_vs_trl as bench  # noqa: E402

from relax.infra.cpu_timeline import descendants  # noqa: E402

KEYS = ("steady_samples_per_s", "step_s_mean", "wait_s_mean", "train_s_mean", "rows_mean",
        "train_ms_per_row", "train_cpu_per_s", "rollout_idle_pct", "reward_mean")


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads that end meanwhile are skipped)."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    for t in tids:
        try:
            os.sched_setaffinity(t, cpus)
        except OSError:  # the thread ended
            pass


def _stage_pids() -> dict[str, int]:
    """Stage name -> pid, from the ``stages.json`` of the run folder that
    ``e2e_vs_trl.run_relax`` makes under the temporary directory (one run at a time)."""
    for f in glob.glob(f"{tempfile.gettempdir()}/relax-bench-*/**/stages.json", recursive=True):
        try:
            return {k: v["pid"] for k, v in json.loads(Path(f).read_text()).items()}
        except (OSError, ValueError):  # being replaced
            continue
    return {}


def pinner(root: int, plan: str, stop: threading.Event) -> None:
    """Until ``stop``, every 0.5 s: the trainer stage on core 0; with ``plan`` ``services``
    ``root`` and every other process below it on core 1, with ``compute`` the rollout
    stage on core 1 and the other processes where the kernel puts them, with ``sync`` the
    rollout on core 0 too (relax sync, whose two stages take turns) and the rest on
    core 1."""
    while not stop.is_set():
        stages = _stage_pids()
        trainer = next((p for n, p in stages.items() if n.startswith("trainer")), None)
        rollout = next((p for n, p in stages.items() if n.startswith("rollout")), None)
        for pid in [root, *descendants(root).values()]:
            if pid == trainer:
                _pin(pid, {0})
            elif pid == rollout:
                _pin(pid, {0} if plan == "sync" else {1})
            elif plan != "compute":
                _pin(pid, {1})
        stop.wait(0.5)


def run(system: str, steps: int, pinned: bool, plan: str, out: Path) -> dict:
    """One ``e2e_vs_trl.py --one`` run; its summary."""
    raw = out.parent / f"raw_pin_{os.getpid()}.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    with (out.parent / f"log_pin_{os.getpid()}.txt").open("w") as lg:
        p = subprocess.Popen([sys.executable, bench.__file__, "--one", system, "--steps",
                              str(steps), "--threads", str(bench.THREADS[system]), "--raw",
                              str(raw)], stdout=lg, stderr=subprocess.STDOUT, env=env)
    stop = threading.Event()
    th = threading.Thread(target=pinner, args=(p.pid, plan, stop), daemon=True)
    if pinned:
        th.start()
    if p.wait() != 0:
        raise SystemExit(f"{system} failed (exit {p.returncode}), see {lg.name}")
    stop.set()
    res = bench.summarise(json.loads(raw.read_text()))
    raw.unlink()
    Path(lg.name).unlink()
    (out.parent / f"timeline_pin_{os.getpid()}.png").unlink(missing_ok=True)  # --one's copy
    return {"pinned": pinned, **{k: res.get(k) for k in KEYS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", default="async2", choices=("async1", "async2", "sync1t"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--plan", default="services", choices=("services", "compute", "sync"),
                    help="services: all but the trainer on core 1; compute: only the "
                         "trainer (core 0) and the rollout (core 1) pinned; sync: both on "
                         "core 0, the rest on core 1")
    ap.add_argument("--out", default=str(HERE / "results" / "core_pinning.json"))
    a = ap.parse_args()
    if (os.cpu_count() or 1) < 2:
        raise SystemExit("needs 2 cores")
    out = Path(a.out)
    runs = []
    for i in range(a.rounds):
        for pinned in (False, True):
            r = run(a.system, a.steps, pinned, a.plan, out)
            runs.append({"round": i, **r})
            print(json.dumps(runs[-1]), flush=True)

    def med(key: str, pinned: bool) -> float:
        return statistics.median(r[key] for r in runs if r["pinned"] is pinned)

    ratio = {k: round(med(k, True) / med(k, False), 3)
             for k in ("steady_samples_per_s", "train_ms_per_row")}
    doc = {"system": a.system, "plan": a.plan, "steps": a.steps,
           "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs, "pinned_over_free": ratio}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"pinned / free (medians): {ratio}; wrote {out}")


if __name__ == "__main__":
    main()

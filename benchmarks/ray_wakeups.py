"""What an idle local Ray costs the stage that computes: its wake-ups and CPU.

    python benchmarks/ray_wakeups.py --json benchmarks/results/ray_wakeups.json

While the trainer of a sync run trains on both cores, every other process that wakes up
preempts one of its torch threads, and the other may wait for it at the next barrier. A
local Ray
(:func:`relax.infra.controller.start_local_ray`) keeps daemons (GCS, raylet, dashboard
agent, log monitor, autoscaler monitor) and one worker process per stage awake while they
wait. This starts a local Ray like a run does, with ``--actors`` idle actors made like a
stage's (``max_concurrency=4``, one call blocked in a worker thread), and counts over
``--seconds`` each process's wake-ups (voluntary context switches of all its threads, from
``/proc/<pid>/task/*/status``) and cores (CPU seconds over wall seconds), with Ray's
defaults (``defaults``) and with relax's (``relax``:
:data:`relax.infra.controller.RAY_IDLE_CONFIG`), alternating for ``--rounds``.

``--sleepers N`` adds what such wake-ups cost: a 2-thread torch loop (6 layers of
``[2048, 576] x [576, 1536]``, forward and backward, 12 passes) alone and beside N
processes that each sleep 10 ms in a loop (100 wake-ups a second each, no work),
alternating for ``--rounds``.

Last line: ``defaults_wakeups=.. relax_wakeups=.. ratio=..`` (per second, all of Ray's
processes, medians over the rounds; with ``--sleepers``, ``train_alone_s=..
train_beside_s=..``). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, os, sys, threading, time
import psutil, ray
from relax.infra.controller import RAY_IDLE_CONFIG, start_local_ray

config, seconds, actors = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
sys.path.insert(0, sys.argv[4])
from thread_cores import thread_wakeups
start_local_ray(2, system_config=RAY_IDLE_CONFIG if config == "relax"
                else json.loads(config) if config.startswith("{") else {})

@ray.remote(max_concurrency=4)
class Idle:
    def __init__(self):
        self.done = threading.Event()
    def pid(self):
        return os.getpid()
    def wait(self, s):
        self.done.wait(s)

idle = [Idle.remote() for _ in range(actors)]
pids = set(ray.get([a.pid.remote() for a in idle]))
calls = [a.wait.remote(seconds + 60) for a in idle]
time.sleep(8)  # past the workers' start-up
procs = psutil.Process().children(recursive=True)

def sample():
    return {p.pid: (sum(thread_wakeups(p.pid).values()), sum(p.cpu_times()[:2]))
            for p in procs}

t0, a = time.monotonic(), sample()
time.sleep(seconds)
wall, b = time.monotonic() - t0, sample()
out = {}
for p in procs:
    name = "idle actor" if p.pid in pids else p.name()
    row = out.setdefault(name, {"processes": 0, "wakeups_per_s": 0.0, "cores": 0.0})
    row["processes"] += 1
    row["wakeups_per_s"] += (b[p.pid][0] - a[p.pid][0]) / wall
    row["cores"] += (b[p.pid][1] - a[p.pid][1]) / wall
print(json.dumps(out))
ray.shutdown()
"""


def measure(config: str, seconds: float, actors: int) -> dict:
    """One local Ray with ``config`` ("defaults", "relax" or a JSON ``_system_config``),
    measured in a fresh process: ``{process name: {"processes", "wakeups_per_s", "cores"}}``."""
    res = subprocess.run([sys.executable, "-c", _CHILD, config, str(seconds), str(actors),
                          str(HERE)],
                         capture_output=True, text=True, timeout=seconds + 180, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def _sleeper(stop) -> None:
    while not stop.is_set():
        time.sleep(0.01)


def train_loop_s() -> float:
    """Seconds of the 2-thread torch loop of ``--sleepers``."""
    import torch

    torch.set_num_threads(2)
    torch.manual_seed(0)
    ws = [torch.randn(576, 1536, requires_grad=True) for _ in range(6)]
    x = torch.randn(2048, 576)
    t = time.perf_counter()
    for _ in range(12):
        h = x
        for w in ws:
            h = torch.tanh(h @ w) @ w.T
        h.square().mean().backward()
    return time.perf_counter() - t


def train_beside(sleepers: int) -> float:
    """:func:`train_loop_s` beside ``sleepers`` processes waking 100 times a second."""
    import multiprocessing as mp

    stop = mp.Event()
    procs = [mp.Process(target=_sleeper, args=(stop,), daemon=True) for _ in range(sleepers)]
    for p in procs:
        p.start()
    time.sleep(0.5)
    try:
        return train_loop_s()
    finally:
        stop.set()
        for p in procs:
            p.join()


def total(rows: dict, key: str) -> float:
    """``key`` summed over every process of one measurement."""
    return sum(r[key] for r in rows.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--actors", type=int, default=4, help="idle stage-like actors")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sleepers", type=int, default=0,
                    help="also time a torch loop alone and beside this many 100-Hz sleepers")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {"defaults": [], "relax": []}
    for rnd in range(a.rounds):
        for config in runs:
            rows = measure(config, a.seconds, a.actors)
            runs[config].append(rows)
            print(f"round {rnd} {config}: wakeups {total(rows, 'wakeups_per_s'):.0f}/s "
                  f"cores {total(rows, 'cores'):.4f}", flush=True)
            for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["wakeups_per_s"]):
                print(f"    {name:24s} x{r['processes']} {r['wakeups_per_s']:7.1f}/s "
                      f"{r['cores']:.4f} cores")
    med = {c: {k: statistics.median(total(r, k) for r in rs)
               for k in ("wakeups_per_s", "cores")} for c, rs in runs.items()}
    train: dict[str, list[float]] = {"alone": [], "beside": []}
    for rnd in range(a.rounds if a.sleepers else 0):
        for name, n in (("alone", 0), ("beside", a.sleepers)):
            train[name].append(train_beside(n))
            print(f"round {rnd} train {name}: {train[name][-1]:.3f} s", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"seconds": a.seconds, "actors": a.actors,
                                      "median": med, "runs": runs, "sleepers": a.sleepers,
                                      "train_s": train}, indent=1))
    d, r = med["defaults"]["wakeups_per_s"], med["relax"]["wakeups_per_s"]
    line = (f"defaults_wakeups={d:.0f} relax_wakeups={r:.0f} ratio={r / d:.3f} "
            f"defaults_cores={med['defaults']['cores']:.4f} "
            f"relax_cores={med['relax']['cores']:.4f}")
    if a.sleepers:
        line += (f" train_alone_s={statistics.median(train['alone']):.3f}"
                 f" train_beside_s={statistics.median(train['beside']):.3f}")
    print(line)


if __name__ == "__main__":
    main()

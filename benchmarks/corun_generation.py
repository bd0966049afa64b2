"""What one core's training costs beside the other core's generation (issue 19).

``e2e_vs_trl.py``'s ``loop1tx2`` measures a one-thread trainer beside another one-thread
loop, which spends about half its time generating and half training. In relax async at
max_staleness 1 the rollout beside the trainer generates for ~70 % of each step and
waits for the rest. Decoding streams the whole model from memory for every token, while
a training step's matrix products reuse each weight for every row of the batch, so the
two co-runners may slow the trainer differently. Here each half runs alone and beside
each kind of co-runner, in separate processes with one torch thread each, over the same
timed window:

* ``train``: the trainer alone (the plain loop's ``train_step`` on the first
  ``--batches`` batches of the e2e workload, made once before the window, over and over);
* ``train+gen``: the trainer beside a process that generates and scores batches
  (``e2e_vs_trl.grpo_groups``) the whole time: relax async's rollout, never idle;
* ``train+train``: beside a second trainer;
* ``gen``: the generator alone.

Each process loads its model and makes its batches first; the window starts at the same
wall-clock time for both (``--start-at``), and only calls that start and end inside it
count. A round runs the four in that order; ``--rounds`` alternates it (odd rounds run
it backwards).

    .venv/bin/python benchmarks/corun_generation.py --seconds 60 --rounds 2

Writes ``benchmarks/results/corun_generation.json``: per run the trainer's ms a row
trained and CPU seconds a second, the generator's seconds a batch; the medians per
setting. Results: RESULTS.md, "2026-12-06 (late night)".
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import e2e_vs_trl as bench  # noqa: E402

SETTINGS = ("train", "train+gen", "train+train", "gen")


def role(kind: str, start_at: float, seconds: float, batches: int, seed: int) -> dict:
    """Run one half at one torch thread from ``start_at`` (epoch seconds) for ``seconds``.

    Args:
        kind: ``"train"`` or ``"gen"``.
        start_at: the window's start, ``time.time()`` seconds.
        seconds: the window's length.
        batches: workload batches made before the window (the trainer's rows).
        seed: the workload's seed.

    Returns:
        ``calls``: per call inside the window, ``s`` (wall seconds), ``rows`` (rows
        trained; 0 for ``gen``) and ``cpu_s`` (this process's CPU seconds).

    Raises:
        RuntimeError: the model load and the batches took past ``start_at``.
    """
    p = bench.loop_parts(bench.workload(steps=max(batches, 8), seed=seed), 1, kind)
    made = [p.sample(i) for i in range(batches)] if kind == "train" else []
    if time.time() > start_at:
        raise RuntimeError(f"{kind}: ready {time.time() - start_at:.1f} s after --start-at")
    time.sleep(start_at - time.time())
    calls, i, end = [], 0, start_at + seconds
    while True:
        t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
        if kind == "train":
            n = p.train(made[i % batches])["rows_computed"]
        else:
            p.sample(i)
            n = 0
        t1, r1 = time.time(), resource.getrusage(resource.RUSAGE_SELF)
        if t1 > end:
            break
        calls.append({"s": t1 - t0, "rows": n,
                      "cpu_s": r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime})
        i += 1
    return {"calls": calls}


def summary(calls: list[dict], kind: str) -> dict:
    """Per-call figures of one role: ``ms_per_row`` (train) or ``s_per_batch`` (gen),
    and ``cpu_per_s`` (CPU seconds per wall second of its calls)."""
    wall = sum(c["s"] for c in calls)
    out = {"calls": len(calls), "cpu_per_s": round(sum(c["cpu_s"] for c in calls) / wall, 3)}
    if kind == "train":
        out["ms_per_row"] = round(1000 * wall / sum(c["rows"] for c in calls), 1)
    else:
        out["s_per_batch"] = round(wall / len(calls), 3)
    return out


def medians(runs: list[dict]) -> dict:
    """``"<setting>:<role>"`` -> the median over the runs of that setting of the role's
    ``ms_per_row`` (train, the first trainer) or ``s_per_batch`` (gen)."""
    med = {}
    for s in SETTINGS:
        for k in ("train", "gen"):
            xs = [r[k]["ms_per_row" if k == "train" else "s_per_batch"]
                  for r in runs if r["setting"] == s and k in r]
            if xs:
                med[f"{s}:{k}"] = round(statistics.median(xs), 3)
    return med


def run_setting(setting: str, seconds: float, batches: int, seed: int,
                lead_s: float) -> dict:
    """Start the setting's processes (``train``, ``gen`` or two joined by ``+``) with one
    window ``lead_s`` from now; their summaries by role (``train``, ``gen``, ``train2``)."""
    kinds = setting.split("+")
    start_at = time.time() + lead_s
    procs = [subprocess.Popen(
        [sys.executable, __file__, "--role", k, "--start-at", str(start_at),
         "--seconds", str(seconds), "--batches", str(batches), "--seed", str(seed)],
        stdout=subprocess.PIPE, text=True) for k in kinds]
    out = {}
    for k, p in zip(kinds, procs):
        text, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"{setting}: the {k} process exited {p.returncode}")
        name = k if k not in out else f"{k}2"
        out[name] = summary(json.loads(text.strip().splitlines()[-1])["calls"], k)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="timed window per run")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--lead-s", type=float, default=60.0,
                    help="from start to the window: model loads and batches")
    ap.add_argument("--out", default=str(HERE / "results" / "corun_generation.json"))
    ap.add_argument("--role", choices=("train", "gen"), help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        print(json.dumps(role(a.role, a.start_at, a.seconds, a.batches, a.seed)))
        return
    runs = []
    for rnd in range(a.rounds):
        for setting in SETTINGS if rnd % 2 == 0 else SETTINGS[::-1]:
            res = run_setting(setting, a.seconds, a.batches, a.seed, a.lead_s)
            runs.append({"round": rnd, "setting": setting, **res})
            print(setting, res, flush=True)
    med = medians(runs)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "seconds": a.seconds,
           "batches": a.batches, "runs": runs, "medians": med}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", a.out)
    print(" ".join(f"{k}={v}" for k, v in med.items()))


if __name__ == "__main__":
    main()

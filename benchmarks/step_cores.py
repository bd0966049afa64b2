"""Who used the cores while the trainer trained, and during the rest of each step: every
process of a finished run, from its own ``cpu_timeline.jsonl`` and ``metrics.jsonl``.

    python benchmarks/step_cores.py RUN_DIR [--from-step 3] [--json OUT]

A run's CPU timeline (``relax.infra.cpu_timeline``) samples every local process of the
run (stages, broker, driver, Ray's daemons) each second. This splits each step from
``--from-step`` on into its *train* window (the trainer's ``train_s`` before the record's
time) and the *rest* (the end of the previous step to the start of training: the weight
handoff, generation, reward, aggregation and the trainer's read), and gives each
process's cores (CPU seconds over wall seconds) in each kind of window: the samples whose
interval ends inside. The first steps are left out by default: they include model
loading and cold memory.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path


def windows(metrics: list[dict], from_step: int) -> dict[str, list[tuple[float, float]]]:
    """``{"train": [(start, end)], "rest": [...]}`` in UNIX seconds, steps >= ``from_step``."""
    def ts(r):
        return datetime.fromisoformat(r["ts"]).timestamp()

    trainer = [r for r in metrics if r["component"] == "trainer"]
    train = {int(r["policy_version"]): (ts(r) - r["value"], ts(r))
             for r in trainer if r["name"] == "train_s"}
    ends = {int(r["policy_version"]): ts(r) for r in trainer if r["name"] == "step_s"}
    out: dict[str, list[tuple[float, float]]] = {"train": [], "rest": []}
    for v in sorted(train):
        if v < from_step:
            continue
        out["train"].append(train[v])
        if v - 1 in ends:
            out["rest"].append((ends[v - 1], train[v][0]))
    return out


def cores_in(rows: list[dict], spans: list[tuple[float, float]]) -> dict[str, float]:
    """Mean cores of each process over the samples ending inside ``spans``, busiest first."""
    per: dict[str, list[float]] = {}
    n = 0
    for a, b in spans:
        inside = [r for r in rows if a < r["ts"] <= b]
        n += len({r["ts"] for r in inside})
        for r in inside:
            per.setdefault(r["name"], []).append(r["cores"])
    return dict(sorted(((k, round(sum(v) / max(n, 1), 4)) for k, v in per.items()),
                       key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--from-step", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = [json.loads(x) for x in (a.run_dir / "cpu_timeline.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (a.run_dir / "metrics.jsonl").read_text().splitlines()]
    spans = windows(metrics, a.from_step)
    res = {k: cores_in(rows, v) for k, v in spans.items()}
    res["seconds"] = {k: round(sum(b - x for x, b in v), 1) for k, v in spans.items()}
    names = list(dict.fromkeys([*res["train"], *res["rest"]]))
    print(f"{'process':28s} {'train':>7s} {'rest':>7s}   "
          f"(train {res['seconds']['train']} s, rest {res['seconds']['rest']} s)")
    for n in names:
        print(f"{n:28s} {res['train'].get(n, 0):7.3f} {res['rest'].get(n, 0):7.3f}")
    print(f"{'all':28s} {sum(res['train'].values()):7.3f} {sum(res['rest'].values()):7.3f}")
    if a.json:
        a.json.write_text(json.dumps({"run_dir": str(a.run_dir), "from_step": a.from_step,
                                      **res}, indent=1))


if __name__ == "__main__":
    main()

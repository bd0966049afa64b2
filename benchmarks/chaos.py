"""Chaos, measured: the tiny recipe N times, each run with stages SIGKILLed or the broker
failed at random moments, early and late.

    python benchmarks/chaos.py --runs 50 --seed 0          # 1-2 min a run on 2 busy cores
    python benchmarks/chaos.py --runs 3 --bootstrap 127.0.0.1:9092   # stage kills only

Every run is ``recipes/tiny_ci.yaml`` (tiny random Llama, 2 partitions, max_staleness 1,
2 groups a step) scored by the parity test reward, with a reference stage that follows
the policy (``kl.coef=0.01``, ``kl.in=loss``, ``reference.follow_every=2``), ``--steps``
optimizer steps (default 14) and a weight snapshot every ``--snapshot-every`` versions
(default 2; the newest 3 are kept). So after step ``3 x snapshot-every`` (the window, 6)
v0's snapshot is gone: a stage restarted later (rollout, reference) must load the newest
kept one. Run 0 is undisturbed (the wall-time reference); runs 1..N get a plan drawn from
``--seed`` by :func:`relax.infra.control.chaos.plan_kills`, each fault after a step in
``1..plan-steps-1`` (default 1..9) plus 0-2 s, early (after a step in the window) or late
(after it) with even odds. The steps after the plan's last are there so that a fault
lands in a live run: an unloaded tiny step takes 0.3-0.6 s, and with 7 steps a fault
drawn after step 5 plus 0.9 s found the trainer finished.

* every ``--broker-every``-th run (default 5: 10 of 50) is a broker fault on a local
  Apache Kafka, alternating: the single node SIGKILLed and restarted from its log dirs
  (``broker:restart``), then one node of a 3-node cluster (replication factor 3,
  ``min.insync.replicas`` 2), the leader of the trainer's input, lost for good
  (``broker:node-lost``; started again between runs).
* every other run kills one stage, two stages, or one stage twice among rollout-0,
  reward.parity, reference, aggregate and trainer, on one local Kafka shared by these
  runs (or the cluster at ``--bootstrap``; then no broker faults).

Reports runs finished, rollouts sampled / trained / stale / filtered / error, rollouts
lost (sampled, in no ledger bucket) and trained twice, the faults that landed
(``broker_kills``, ``late_kills``: after the window) and wall time against the
undisturbed run. Writes ``benchmarks/results/chaos.json`` after every run (``complete``
false until all ran; ``--budget-s`` starts no run that would end past it; ``--resume``
goes on from the runs a stopped pass wrote there, same seed, same plans); the last line
is ``finished=F/N lost=L trained_twice=T broker_kills=B late_kills=K ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
import uuid
from pathlib import Path

from relax.benchmarks.harness import RESULTS, tiny_recipe, write_result

KEPT_SNAPSHOTS = 3
"""Weight snapshots the trainer keeps (streams/weights): the window is this many times
``weights_snapshot_every`` versions."""


def _landed_after(killed: str) -> int:
    """The step of a landed kill, ``stage@STEP+delay`` (:attr:`ChaosResult.killed`)."""
    return int(killed.split("@", 1)[1].split("+", 1)[0])


def _summary(a, stages, window, base, chaos, t_start) -> dict:
    from relax.infra.control.chaos import BROKER_FAULTS

    def mean_wall(rs):
        return round(sum(r.wall_s for r in rs) / len(rs), 1) if rs else None

    stage_runs = [r for r in chaos if not any(k.stage in BROKER_FAULTS for k in r.kills)]
    broker_runs = [r for r in chaos if r not in stage_runs]
    landed = [k for r in chaos for k in r.killed]
    return {
        "runs": len(chaos), "planned_runs": a.runs, "complete": len(chaos) == a.runs,
        "finished": sum(r.finished for r in chaos),
        "lost": sum(r.lost for r in chaos), "trained_twice": sum(r.trained_twice for r in chaos),
        "broker_kills": sum(k.startswith("broker:") for k in landed),
        "broker_restarts": sum(k.startswith("broker:restart") for k in landed),
        "broker_nodes_lost": sum(k.startswith("broker:node-lost") for k in landed),
        "late_kills": sum(_landed_after(k) > window for k in landed),
        "kills_landed": len(landed),
        "kills_planned": sum(len(r.kills) for r in chaos),
        "seed": a.seed, "steps": a.steps, "plan_steps": a.plan_steps,
        "weights_snapshot_every": a.snapshot_every,
        "window_steps": window, "stages": list(stages),
        "undisturbed_wall_s": base.wall_s, "undisturbed_finished": base.finished,
        "wall_s_mean": mean_wall(chaos),
        "wall_over_undisturbed": round(mean_wall(chaos) / max(base.wall_s, 1e-9), 2)
        if chaos else None,
        "stage_kill_runs": len(stage_runs), "stage_kill_wall_s_mean": mean_wall(stage_runs),
        "broker_fault_runs": len(broker_runs), "broker_fault_wall_s_mean": mean_wall(broker_runs),
        "broker_outage_s": [r.broker_outage_s for r in broker_runs if r.broker_outage_s],
        **{k: sum(getattr(r, k) for r in chaos)
           for k in ("sampled", "trained", "stale", "filtered", "errors")},
        "benchmark_wall_s": round(time.monotonic() - t_start, 1),
        "resumed_at_run": a.resumed_at,
        "measured_on": f"{os.cpu_count()} cores (shared, busy), {time.strftime('%Y-%m-%d')}",
        "per_run": [r.as_dict() for r in [base, *chaos]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="chaos runs (plus one undisturbed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=14, help="optimizer steps per run")
    ap.add_argument("--plan-steps", type=int, default=10,
                    help="faults are drawn after steps 1..plan-steps-1 (at most --steps)")
    ap.add_argument("--snapshot-every", type=int, default=2,
                    help="trainer.weights_snapshot_every (window: 3x this many steps)")
    ap.add_argument("--broker-every", type=int, default=5,
                    help="every Nth run is a broker fault on a local Kafka (0: none)")
    ap.add_argument("--bootstrap", default=None, help="use this Kafka cluster (stage kills only)")
    ap.add_argument("--run-root", default=None, help="run folders (default: a temp folder)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per run")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no run that would likely end past this many seconds")
    ap.add_argument("--out", default=str(RESULTS / "chaos.json"))
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs --out holds (same seed and settings) and run the rest")
    a = ap.parse_args()

    import contextlib
    import tempfile

    from relax.infra.broker.kafka import start_kafka
    from relax.infra.broker.local import LocalBroker, stop_broker
    from relax.infra.control.chaos import (
        BROKER_NODE_LOST,
        BROKER_RESTART,
        STAGES,
        ChaosResult,
        Kill,
        chaos_run,
        plan_kills,
    )
    from relax.infra.control.controller import start_local_ray

    t_start = time.monotonic()
    os.environ.setdefault("RELAX_HOME", tempfile.mkdtemp(prefix="relax-chaos-home-"))
    start_local_ray(8)  # one Ray for every run (each run's controller finds it up), its
    # stage processes with RELAX_HOME above; saves a Ray start and stop per run
    stages = STAGES + ("reference",)
    window = a.snapshot_every * KEPT_SNAPSHOTS
    extra = [f"trainer.steps={a.steps}", f"trainer.weights_snapshot_every={a.snapshot_every}",
             "kl.coef=0.01", "kl.in=loss", "reference.follow_every=2"]
    rng = random.Random(a.seed)
    root = Path(a.run_root or tempfile.mkdtemp(prefix="relax-chaos-"))
    kafka: dict[str, object] = {}  # fault -> handle, started on first use, kept to the end

    def kafka_for(fault: str):
        if fault not in kafka:
            kafka[fault] = start_kafka(root / f"kafka-{fault.split(':')[1]}",
                                       brokers=3 if fault == BROKER_NODE_LOST else 1)
        else:  # a node lost in the previous run comes back (its own run's topics are its)
            h = start_kafka(kafka[fault].data_dir)
            kafka[fault].pid, kafka[fault].nodes = h.pid, h.nodes
        return kafka[fault]

    results = []
    if a.resume:
        done = json.loads(Path(a.out).read_text())
        for k in ("seed", "steps", "plan_steps", "weights_snapshot_every"):
            if done[k] != getattr(a, {"weights_snapshot_every": "snapshot_every"}.get(k, k)):
                raise SystemExit(f"--resume: {a.out} has {k}={done[k]}, not this pass's")
        results = [ChaosResult(**{**r, "kills": [Kill(**k) for k in r["kills"]]})
                   for r in done["per_run"]]
        t_start -= done["benchmark_wall_s"]
    a.resumed_at = done.get("resumed_at_run") or len(results) if a.resume else None
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: [stop_broker(h) for h in kafka.values()])
        shared = a.bootstrap or stack.enter_context(LocalBroker()).bootstrap
        for i in range(a.runs + 1):
            fault = None
            if i and a.broker_every and not a.bootstrap and i % a.broker_every == 0:
                fault = (BROKER_RESTART, BROKER_NODE_LOST)[(i // a.broker_every - 1) % 2]
            kills = [] if i == 0 else plan_kills(rng, a.plan_steps, stages, window, fault)
            if i < len(results):  # resumed: this run is done (its plan drawn again, the same)
                if results[i].kills != kills:
                    raise SystemExit(f"--resume: run {i}'s plan is not the one {a.out} holds")
                continue
            if a.budget_s and len(results) > 1:
                per_run = (time.monotonic() - t_start) / len(results)
                if time.monotonic() - t_start + 1.5 * per_run > a.budget_s:
                    print(f"budget: {a.budget_s}s would be passed; stopping before run {i}",
                          flush=True)
                    break
            broker = kafka_for(fault) if fault else None
            run = f"chaos{i:02d}{uuid.uuid4().hex[:4]}"
            recipe = tiny_recipe(broker.bootstrap if broker else shared, root, run, *extra)
            r = chaos_run(recipe, kills, a.timeout_s, broker=broker)
            results.append(r)
            print(f"run {i:2d} {'ok ' if r.finished else 'FAIL'} wall_s={r.wall_s:6.1f} "
                  f"killed={','.join(r.killed) or '-'} sampled={r.sampled} trained={r.trained} "
                  f"stale={r.stale} filtered={r.filtered} errors={r.errors} lost={r.lost} "
                  f"trained_twice={r.trained_twice}"
                  + (f" outage_s={r.broker_outage_s}" if r.broker_outage_s else "")
                  + (f"\n    broker: {r.broker_error.splitlines()[0]}" if r.broker_error else "")
                  + (f"\n    {r.error.splitlines()[0]}" if r.error else ""), flush=True)
            out = _summary(a, stages, window, results[0], results[1:], t_start)
            write_result(a.out, out)
    print(f"finished={out['finished']}/{out['runs']} lost={out['lost']} "
          f"trained_twice={out['trained_twice']} broker_kills={out['broker_kills']} "
          f"late_kills={out['late_kills']} wall_over_undisturbed={out['wall_over_undisturbed']} "
          f"(undisturbed {results[0].wall_s}s)")


if __name__ == "__main__":
    main()

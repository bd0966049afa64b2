"""Rollout instances, measured: the same run with 1, then 2 (or ``--instances``) rollout
processes in one consumer group, with long responses.

    python benchmarks/rollout_scaling.py                      # 1 vs 2, ~4 min on 2 cores
    python benchmarks/rollout_scaling.py --max-new-tokens 256 --group-size 2

Each run is ``recipes/tiny_ci.yaml`` (tiny random Llama, which rarely stops early, so
nearly every response is ``--max-new-tokens`` long) scored by the parity test reward:
``--batch-groups`` groups of ``--group-size`` a step, ``--max-staleness`` (2), every
rollout process 1 torch thread, one local broker, a checkpoint only at the end (their
~37 MB writes are not what is measured). Throughput = samples the trainer decided on
(``batch_groups x group_size`` a step) per second between the first and the last step
(the steady state: model loading and the first batch left out). Reports each run's
samples/s, its ratio to the first run, and the fractions of the steady state the
trainer spent waiting for data and training (a trainer that mostly waits: the rollouts
are the bottleneck). Writes ``benchmarks/results/rollout_scaling.json``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid

from relax.benchmarks.harness import RESULTS, broker, tiny_recipe, write_result


def one_run(bootstrap: str, run_root: str, instances: int, a) -> dict:
    """The run with ``instances`` rollout processes: steady samples/s and its summary."""
    from relax.infra.control.launch import train

    recipe = tiny_recipe(bootstrap, run_root, f"scale{instances}-" + uuid.uuid4().hex[:4],
                         f"rollout.instances={instances}", f"trainer.steps={a.steps}",
                         f"rollout.max_new_tokens={a.max_new_tokens}",
                         f"trainer.batch_groups={a.batch_groups}", "rollout.groups_per_generate=1",
                         f"rollout.group_size={a.group_size}",
                         f"max_staleness={a.max_staleness}", "trainer.checkpoint_every=0")
    stamps: list[float] = []
    rows: list[dict] = []

    def on_step(row: dict, _run_dir) -> None:
        stamps.append(time.monotonic())
        rows.append(row)

    t0 = time.monotonic()
    s = train(recipe, say=lambda _: None, on_step=on_step, timeout_s=a.timeout_s)
    steady = rows[1:]
    wait = sum(float(r.get("data_wait_s", 0.0)) for r in steady)
    busy = sum(float(r.get("train_s", 0.0)) for r in steady)
    samples = (len(stamps) - 1) * a.batch_groups * a.group_size
    return {"instances": instances, "samples_per_s": samples / (stamps[-1] - stamps[0]),
            "steady_s": stamps[-1] - stamps[0], "wall_s": time.monotonic() - t0,
            "first_step_s": stamps[0] - t0, "trainer_wait_frac": wait / (stamps[-1] - stamps[0]),
            "trainer_train_frac": busy / (stamps[-1] - stamps[0]),
            **{k: s[k] for k in ("steps", "sampled", "trained", "stale", "filtered",
                                 "errors", "balanced")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", default="1,2", help="rollout processes of each run")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--bootstrap", help="an existing cluster (default: a local Kafka started "
                    "for the runs)")
    ap.add_argument("--out", default=str(RESULTS / "rollout_scaling.json"))
    a = ap.parse_args()

    os.environ.setdefault("RELAX_HOME", tempfile.mkdtemp(prefix="relax-scale-home-"))
    runs = []
    with broker(a.bootstrap) as (bootstrap, _), \
            tempfile.TemporaryDirectory(prefix="relax-scale-") as root:
        for n in (int(x) for x in a.instances.split(",")):
            r = one_run(bootstrap, root, n, a)
            runs.append(r)
            print(f"instances={n} samples/s={r['samples_per_s']:.2f} steady_s={r['steady_s']:.1f} "
                  f"trainer wait={r['trainer_wait_frac']:.0%} train={r['trainer_train_frac']:.0%} "
                  f"sampled={r['sampled']} balanced={r['balanced']}", flush=True)
    base = runs[0]["samples_per_s"]
    for r in runs:
        r["ratio"] = r["samples_per_s"] / base
    write_result(a.out, {"settings": vars(a), "runs": runs})
    print(" ".join(f"x{r['instances']}={r['ratio']:.2f}" for r in runs))


if __name__ == "__main__":
    main()

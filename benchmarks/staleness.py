"""Far off-policy: does M2PO keep on-policy accuracy where GRPO's PPO-clip falls as the
rollouts get staler? (issue 57)

    python -m relax.benchmarks.staleness                 # the grid: 3 staleness x 2 losses x 3 seeds
    python -m relax.benchmarks.staleness --seeds 1 --staleness 16 --losses m2po   # one cell
    python -m relax.benchmarks.staleness --resume        # add the runs the results file lacks

The task is the demo's (``recipes/arith_m2po_async.yaml``, the demo recipe with M2PO at
max_staleness 16): SmolLM2-135M-Instruct, reasoning-gym 2-digit additions, 8 samples a
prompt at temperature 0.7, AdamW lr 2e-5, one optimizer step a batch. Each run is
``relax train`` (the product's entry point, every stage its own process, the run's own
local Kafka) with these overrides:

* ``trainer.max_staleness`` 0 (``mode: sync``: the rollout waits for each step), 4 or 16
  (``mode: async``: the rollout stage may sample ``(s + 1) * batch_groups`` groups ahead
  of the trainer, :mod:`relax.streams.progress`);
* ``trainer.loss.policy_loss`` ``ppo_clip`` (GRPO: clip eps 0.2 on the ratio to the
  behaviour policy, ``old_logprobs: rollout``) or ``m2po`` (``m2_threshold`` 0.04);
* the same number of trained samples in every run: ``--steps`` x ``--batch-groups`` x 8
  (default 32 x 2 = 512, 40 % of the demo's 1,280: 18 runs of the demo's length do not
  fit an hour on a shared 2-core machine); batches of 2 groups instead of the demo's 8 so
  that a run has enough policy versions for staleness 16 to happen (a sample can be at
  most ``steps - 1`` versions stale, and the rollout gains on the trainer about one batch
  a step);
* ``rollout.seed`` = ``trainer.seed`` = the seed; the prompts are the same in every run;
* the rollout must run ahead of the trainer for the staleness bound to be reached, and on
  a loaded 2-core machine with the demo's 8 groups an engine call it does not (measured:
  its calls took as long as the trainer's steps on them, since the trainer skips the
  rows of groups with no reward variance; mean staleness 4-7 at ``max_staleness`` 16).
  So in every run the rollout samples ``--groups-per-generate`` (default 16) groups in
  one engine call, as far as its credit of ``(s + 1) * batch_groups`` groups allows
  (at s=16 two calls of 8 batches each before the trainer needs them), at
  ``--rollout-threads`` torch threads (default 2; the trainer 1);
* held-out accuracy: greedy, the first ``--eval-size`` (default 100) prompts of the demo's
  eval set, every ``--eval-every`` versions by the eval stage (``eval.every``; its row at
  the last version is the accuracy after training); the base model's once, by
  ``relax eval``.

Per run, from the run's ``metrics.jsonl``: the accuracy curve; ``staleness_mean`` (the
trainer's per-step mean staleness of the trained samples, averaged over the run weighted
by samples) and ``staleness_max``; the masked-token share: the token share of the loss
tokens that the policy loss cut off, ``clip_frac_low + clip_frac_high`` for PPO-clip
(ratio outside [0.8, 1.2] on the side the advantage pushes) and ``m2po_masked_frac`` for
M2PO, token-weighted over the run; M2PO's second moment ``m2`` (mean ``(log r)^2``);
samples trained and dropped as stale; wall seconds.

Writes ``benchmarks/results/staleness.json`` after every run (a partial grid counts: the
``cells`` table says how many seeds each cell has) and ``staleness.png`` (curves and final
accuracies; needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from relax.benchmarks.harness import RESULTS, ROOT, write_result

RECIPE = ROOT / "recipes" / "arith_m2po_async.yaml"
OUT = RESULTS / "staleness.json"
LOSSES = {"grpo": "ppo_clip", "m2po": "m2po"}
"""The compared losses: name in the results -> ``trainer.loss.policy_loss``."""
MASK_METRICS = {"ppo_clip": ("clip_frac_low", "clip_frac_high"), "m2po": ("m2po_masked_frac",)}
"""Per policy loss, the trainer metrics (token shares) whose sum is the masked-token share."""


def relax_cli(a: argparse.Namespace) -> list[str]:
    """The ``relax`` command: ``--relax-cmd`` split on spaces, else the console script of
    this Python's environment (the venv's ``relax``)."""
    return a.relax_cmd.split() if a.relax_cmd else [str(Path(sys.executable).with_name("relax"))]


def overrides(loss: str, staleness: int, seed: int, a: argparse.Namespace) -> list[str]:
    """The ``key=value`` overrides of one run on :data:`RECIPE`."""
    return [f"mode={'sync' if staleness == 0 else 'async'}",
            f"trainer.max_staleness={staleness}",
            f"trainer.loss.policy_loss={LOSSES[loss]}",
            f"trainer.steps={a.steps}", f"trainer.batch_groups={a.batch_groups}",
            f"rollout.seed={seed}", f"trainer.seed={seed}",
            f"resources.rollout.torch_threads={a.rollout_threads}",
            f"rollout.groups_per_generate={a.groups_per_generate}",
            f"eval.size={a.eval_size}", f"eval.every={a.eval_every}",
            "eval.before=false", "eval.after=false"]


def base_accuracy(a: argparse.Namespace) -> dict:
    """The base model's greedy held-out accuracy on the same eval prompts (``relax eval``):
    ``{"accuracy", "correct", "n", "wall_s"}``.

    Raises:
        RuntimeError: ``relax eval`` failed or printed no accuracy (its output in the
            message).
    """
    t0 = time.time()
    p = subprocess.run([*relax_cli(a), "eval", str(RECIPE), f"eval.size={a.eval_size}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False)
    for line in p.stdout.splitlines():
        # "greedy held-out accuracy 29/100 = 0.290 ..."
        if "accuracy" in line and "/" in line and "=" in line:
            frac, acc = line.split("accuracy", 1)[1].split("=")[:2]
            correct, n = (int(x) for x in frac.split()[-1].split("/"))
            return {"accuracy": float(acc.split()[0]), "correct": correct, "n": n,
                    "wall_s": round(time.time() - t0, 1)}
    raise RuntimeError(f"relax eval (rc {p.returncode}) printed no accuracy:\n"
                       f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


def summarize(rows: list[dict], policy_loss: str, steps: int) -> dict:
    """One run's figures from its ``metrics.jsonl`` rows (module docstring).

    Raises:
        ValueError: the run has fewer trainer steps than ``steps``, or a policy_version
            was trained twice (the trainer restarted: without checkpoints it starts again
            from the base model, and the run's curve is no longer one training).
    """
    from relax.infra.observe.report import step_rows

    per_step = step_rows(rows)
    if len(per_step) < steps:
        raise ValueError(f"the run trained {len(per_step)} of {steps} steps")
    seen = Counter(int(r["policy_version"]) for r in rows
                   if r["component"] == "trainer" and r["name"] == "step_s")
    twice = sorted(v for v, n in seen.items() if n > 1)
    if twice:
        raise ValueError(f"the trainer restarted: policy_versions {twice[0]}-{twice[-1]} were "
                         f"trained twice")
    curve: dict[int, float] = {}
    for r in rows:
        if r["component"] == "eval" and r["name"] == "eval_accuracy":
            curve[int(r["policy_version"])] = r["value"]
    samples = [s.get("samples_trained", 0) for s in per_step]
    tokens = [s.get("tokens_trained", 0) for s in per_step]

    def weighted(values: list[float], weights: list[float]) -> float | None:
        return sum(v * w for v, w in zip(values, weights)) / sum(weights) if sum(weights) else None

    masked = [sum(s.get(k, 0.0) for k in MASK_METRICS[policy_loss]) for s in per_step]
    out = {
        "accuracy_curve": {str(k): curve[k] for k in sorted(curve)},
        "accuracy_after": curve.get(steps),
        "staleness_mean": weighted([s.get("staleness_mean", 0.0) for s in per_step], samples),
        "staleness_max": max(s.get("staleness_max", 0) for s in per_step),
        "staleness_per_step": [s.get("staleness_mean") for s in per_step],
        "masked_token_share": weighted(masked, tokens),
        "masked_per_step": masked,
        "samples_trained": sum(samples),
        "samples_dropped_stale": sum(s.get("samples_dropped_stale", 0) for s in per_step),
        "reward_trained_last5": statistics.fmean(s.get("reward_mean_trained", 0.0)
                                                 for s in per_step[-5:]),
    }
    if policy_loss == "m2po":
        out["m2_mean"] = weighted([s.get("m2", 0.0) for s in per_step], tokens)
    return out


def run_one(loss: str, staleness: int, seed: int, a: argparse.Namespace) -> dict:
    """``relax train`` of one cell and seed; its figures (:func:`summarize`), or
    ``{"error": ...}`` with the tail of its output when it failed."""
    name = f"stale-{loss}-s{staleness}-seed{seed}-{time.strftime('%H%M%S')}"
    with tempfile.TemporaryDirectory(prefix="relax-staleness-") as root:
        head = [*relax_cli(a), "train", str(RECIPE), f"run={name}", f"run_root={root}"]
        cmd = [*head, *overrides(loss, staleness, seed, a)]
        t0 = time.time()
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           timeout=a.run_timeout_s, check=False)
        wall = round(time.time() - t0, 1)
        res = {"loss": loss, "max_staleness": staleness, "seed": seed, "wall_s": wall,
               "overrides": cmd[len(head):]}
        metrics = Path(root) / name / "metrics.jsonl"
        if p.returncode != 0 or not metrics.exists():
            return {**res, "error": f"rc {p.returncode}: " + (p.stdout + p.stderr)[-1500:]}
        if a.metrics_dir:
            a.metrics_dir.mkdir(parents=True, exist_ok=True)
            shutil.copy(metrics, a.metrics_dir / f"{name}.jsonl")
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        try:
            return {**res, **summarize(rows, LOSSES[loss], a.steps)}
        except ValueError as e:
            return {**res, "error": str(e)}


def cells(runs: list[dict], staleness: list[int]) -> list[dict]:
    """Per (loss, max_staleness): the seeds done, final accuracy mean and sample std, mean
    staleness reached, masked-token share, over the runs that finished."""
    out = []
    for loss in LOSSES:
        for s in staleness:
            mine = [r for r in runs if r["loss"] == loss and r["max_staleness"] == s
                    and "error" not in r and r.get("accuracy_after") is not None]
            accs = [r["accuracy_after"] for r in mine]

            def mean(key: str, rs=mine):
                vals = [r[key] for r in rs if r.get(key) is not None]
                return statistics.fmean(vals) if vals else None

            out.append({"loss": loss, "max_staleness": s, "seeds": [r["seed"] for r in mine],
                        "accuracy_after_mean": statistics.fmean(accs) if accs else None,
                        "accuracy_after_std": statistics.stdev(accs) if len(accs) > 1 else None,
                        "accuracy_after": accs, "staleness_mean": mean("staleness_mean"),
                        "staleness_max": max((r["staleness_max"] for r in mine), default=None),
                        "masked_token_share": mean("masked_token_share"),
                        "wall_s_mean": mean("wall_s")})
    return out


def plot(doc: dict, path: Path) -> Path | None:
    """Accuracy curves (mean over seeds, one line per cell) and final accuracies (mean,
    sample std as error bars) to ``path``; None when matplotlib is not installed."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = doc["base"]["accuracy"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {0: "tab:green", 4: "tab:orange", 16: "tab:red"}
    for c in doc["cells"]:
        mine = [r for r in doc["runs"] if r["loss"] == c["loss"]
                and r["max_staleness"] == c["max_staleness"] and "error" not in r]
        if not mine:
            continue
        versions = sorted({int(v) for r in mine for v in r["accuracy_curve"]})
        ys = [statistics.fmean(r["accuracy_curve"][str(v)] for r in mine
                               if str(v) in r["accuracy_curve"]) for v in versions]
        left.plot([0, *versions], [base, *ys], marker="o",
                  linestyle="-" if c["loss"] == "m2po" else "--",
                  color=colors.get(c["max_staleness"], "tab:blue"),
                  label=f"{c['loss']} s={c['max_staleness']} (n={len(mine)})")
    left.set_xlabel("policy_version")
    left.set_ylabel("greedy held-out accuracy")
    if left.lines:
        left.legend(fontsize=8)
    labels = [f"{c['loss']}\ns={c['max_staleness']}" for c in doc["cells"]]
    right.bar(range(len(labels)), [c["accuracy_after_mean"] or 0 for c in doc["cells"]],
              yerr=[c["accuracy_after_std"] or 0 for c in doc["cells"]],
              color=[colors.get(c["max_staleness"], "tab:blue") for c in doc["cells"]])
    right.axhline(base, color="gray", linestyle=":", label=f"base {base:.2f}")
    right.set_xticks(range(len(labels)), labels, fontsize=8)
    right.set_ylabel("accuracy after training (mean, std over seeds)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--staleness", default="0,4,16")
    ap.add_argument("--losses", default="grpo,m2po")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch-groups", type=int, default=2)
    ap.add_argument("--eval-size", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=8)
    ap.add_argument("--rollout-threads", type=int, default=2)
    ap.add_argument("--groups-per-generate", type=int, default=16)
    ap.add_argument("--run-timeout-s", type=float, default=1800)
    ap.add_argument("--relax-cmd", default=None,
                    help="the relax command to run (default: this venv's relax), e.g. "
                    "'python /path/relax_main.py' to run a frozen copy of the package")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--note", default=None, help="a note on the machine of the results")
    ap.add_argument("--metrics-dir", type=Path, default=None,
                    help="keep a copy of each run's metrics.jsonl here (<run>.jsonl)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs of --out with the same settings; run only the others")
    a = ap.parse_args()
    staleness = [int(x) for x in a.staleness.split(",")]
    losses = a.losses.split(",")
    seeds = [int(x) for x in a.seeds.split(",")]
    settings = {"recipe": str(RECIPE.relative_to(ROOT)), "steps": a.steps,
                "batch_groups": a.batch_groups, "group_size": 8,
                "trained_samples": a.steps * a.batch_groups * 8, "eval_size": a.eval_size,
                "eval_every": a.eval_every, "rollout_threads": a.rollout_threads,
                "groups_per_generate": a.groups_per_generate,
                "trainer_threads": 1, "m2_threshold": 0.04, "clip_eps": 0.2, "lr": 2e-5}
    runs: list[dict] = []
    failed: list[dict] = []  # runs that did not finish or restarted, kept for the record
    base = None
    if a.resume and a.out.exists():
        old = json.loads(a.out.read_text())
        if old.get("settings") == settings:
            runs = [r for r in old["runs"] if "error" not in r]
            failed = [*old.get("failed_runs", []), *(r for r in old["runs"] if "error" in r)]
        if old.get("settings", {}).get("eval_size") == a.eval_size:
            base = old.get("base")
    if base is None:
        base = base_accuracy(a)
        print(f"base: greedy held-out accuracy {base['accuracy']:.3f} (n={base['n']})", flush=True)
    done = {(r["loss"], r["max_staleness"], r["seed"]) for r in runs}
    # seed-major: a partial grid has every cell once before any has twice
    todo = [(loss, s, seed) for seed in seeds for s in staleness for loss in losses
            if (loss, s, seed) not in done]
    all_staleness = sorted({*staleness, *(r["max_staleness"] for r in runs)})

    def save() -> None:
        doc = {"settings": settings, "base": base, "runs": runs,
               "cells": cells(runs, all_staleness), "failed_runs": failed}
        write_result(a.out, doc, **({"note": a.note} if a.note else {}))
        png = plot(doc, a.out.with_suffix(".png"))
        if png is None:
            print("matplotlib is not installed: no plot", flush=True)

    for i, (loss, s, seed) in enumerate(todo, 1):
        r = run_one(loss, s, seed, a)
        runs.append(r)
        save()
        print(f"[{i}/{len(todo)}] {loss} s={s} seed={seed}: "
              + (f"error {r['error'][-300:]}" if "error" in r else
                 f"accuracy {r['accuracy_after']} staleness mean {r['staleness_mean']:.2f} "
                 f"max {r['staleness_max']} masked {r['masked_token_share']:.4f}")
              + f" ({r['wall_s']:.0f} s)", flush=True)
    if not todo:
        save()


if __name__ == "__main__":
    main()

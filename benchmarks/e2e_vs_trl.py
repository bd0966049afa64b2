"""End to end, same CPU workload: TRL's GRPOTrainer, a plain single-process GRPO loop,
relax sync and relax async (max_staleness 1 and 2).

    python benchmarks/e2e_vs_trl.py                 # all systems, 8 steps each: ~35 min on 2 cores
    python benchmarks/e2e_vs_trl.py --steps 2 --systems loop,async1   # a quick look
    python benchmarks/e2e_vs_trl.py --steps 16 --systems loop,async1,trl --seed 2 \
        --out /tmp/e2e_seed2.json                     # other samples: the reward's spread
    python benchmarks/e2e_vs_trl.py --steps 12 --systems sync --bootstrap HOST:PORT \
        --fetch-wait-ms 1000 --out /tmp/sync.json     # relax on a cluster of your own
    python benchmarks/e2e_vs_trl.py --steps 10 --systems async1 --trainer-processes 2 \
        --out /tmp/async_2ranks.json                  # two data-parallel trainer ranks

The workload is the demo's (``recipes/arith_grpo_smollm2.yaml``): SmolLM2-135M-Instruct,
reasoning-gym 2-digit additions (fixed seed, the same prompts in the same order for
every system), G=8 samples per prompt, 8 prompts per optimizer step, 12 new tokens at
temperature 0.7, AdamW lr 2e-5, grad clip 5, one PPO-clip step per batch (eps 0.2),
token-mean loss (TRL ``loss_type="dapo"``), no KL, reward 1 if the last number of
the reply equals the sum (relax's ``gsm8k`` scorer, ``flexible``) for every system.

Each system runs in its own subprocess (``--one SYSTEM``) and reports, per step, the
wall time at the end of the step, the trained samples, the seconds the trainer
waited for data and the mean reward of the trained samples. From those:

* ``samples_per_s``: trained samples / seconds from the start of training (after the
  process has loaded its models; relax: from the start of its stages, so its stage
  start-up is included) to the end of the last step;
* ``steady_samples_per_s``: samples of steps 2..N / time from the end of step 1 to
  the end of step N (start-up and the first, cold step left out), less the seconds
  relax's trainer spent writing checkpoints in those steps (``checkpoint_s``: the last
  step writes one; the loop and TRL write none; the e2e rate keeps them): the ratios
  use this;
* ``data_wait_pct``: trainer seconds waiting for data / step seconds, steps 2..N (a
  single-process loop waits for the whole of its generation and scoring);
* ``rollout_idle_pct``: seconds the generator was not generating / the same window
  (single process: its training time; relax: the rollout stage's weight and budget
  waits);
* ``rows_mean``: rows trained a step (rows of zero-variance groups are skipped, so
  systems that sample different answers, like async against the loop, train different
  numbers; the loop and relax sync sample the same);
  ``train_ms_per_row``: training seconds per row trained; ``train_cpu_per_s``: the
  trainer process's CPU seconds per second of training (all its threads);
  ``train_faults_per_row``: its minor page faults per row trained;
* ``limit`` / ``limit_corun``: the best perfect overlap of the halves on 2 cores
  (:func:`derived_limit`), from one-thread times measured alone (``loop1t``) or with
  the other core busy (``loop1tx2``); ``limit_rows``: ``limit`` with the loops'
  training times scaled to the best async system's rows a step;
* ``trainer_data_wait_floor``: the data-wait share the best async system's staleness
  bound forces even with perfect hand-offs (:mod:`relax.benchmarks.wait_floor`: its
  own training times a step, the ``loop1tx2`` generation time a batch): where its steps
  train in less time than one batch takes to generate, the trainer must wait, since
  the next batch may not be sampled with older weights;
* ``sync_over_loop_1thread``: relax sync at one torch thread a stage (``sync1t``) over
  the one-thread loop (``loop1t``): the bus and processes' cost when one of the 2 cores
  is left to the waiting processes, as on a GPU node's host.

Writes ``benchmarks/results/e2e_vs_trl.json`` (with ``async_over_sync`` and
``relax_over_trl``, ratios of steady samples/s) and ``e2e_vs_trl.png``; last line
``async_over_sync=X relax_over_trl=Y ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from relax.benchmarks.harness import RESULTS, ROOT, write_result
from relax.benchmarks.wait_floor import floor_pct

RECIPE = ROOT / "recipes" / "arith_grpo_smollm2.yaml"
SYSTEMS = {
    "trl": "TRL GRPOTrainer",
    "loop": "plain torch loop",
    "loop1t": "plain torch loop, 1 thread",
    "sync": "relax sync",
    "sync1t": "relax sync, 1 thread/stage",
    "async1": "relax async s=1",
    "async2": "relax async s=2",
    "syncgloo": "relax sync, weights by broadcast (no /dev/shm)",
    "colocate": "relax colocate (rollout and trainer in one process, one model)",
    "loop1tx2": "two 1-thread plain loops side by side",
}


def workload(steps: int, seed: int = 1) -> dict:
    """The settings every system shares (from the demo recipe); ``seed`` seeds the
    sampling of every system (the prompts stay the same: the source has its own seed)."""
    import yaml

    r = yaml.safe_load(RECIPE.read_text())
    return {
        "model": r["model"], "source": r["data"]["source"],
        "prompt_field": r["data"]["prompt_field"], "label_field": r["data"]["label_field"],
        "prompt_template": r["rollout"]["prompt_template"],
        "group_size": r["rollout"]["group_size"], "batch_groups": r["trainer"]["batch_groups"],
        "max_new_tokens": r["rollout"]["max_new_tokens"],
        "temperature": r["rollout"]["temperature"], "lr": r["trainer"]["optim"]["lr"],
        "grad_clip": r["trainer"]["optim"]["grad_clip"], "clip_eps": 0.2, "steps": steps,
        "seed": seed, "reward": "gsm8k flexible (last number == label)",
        "loss": "ppo_clip + token-mean (TRL loss_type=dapo), beta=0",
    }


def prompt_rows(w: dict) -> list[dict]:
    """The first ``steps x batch_groups`` prompts of the source, in order."""
    from relax.producers.sources import read_source

    n = w["steps"] * w["batch_groups"]
    return [s.record for s in read_source(w["source"], n)]


def score(responses: list[str], labels: list[str]) -> list[float]:
    """relax's GSM8K scorer in ``flexible`` mode (last number of the reply)."""
    from relax.consumers.reward.gsm8k import gsm8k_reward

    return [float(s.value or 0.0) for s in
            gsm8k_reward(responses, labels, [{}] * len(labels), mode="flexible")]


# ------------------------------------------------------------------ one system each
def run_trl(w: dict, threads: int) -> dict:
    """TRL 1.16 GRPOTrainer (generation with the training model, HF generate)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relax.trainer.models import load

    torch.set_num_threads(threads)
    rows = prompt_rows(w)
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": w["prompt_template"].format(
        prompt=r[w["prompt_field"]])}], "answer": str(r[w["label_field"]])} for r in rows])
    model, tok = load(w["model"])
    tok.padding_side = "left"
    per_step: list[dict] = []
    clock = {"gen": 0.0, "t0": 0.0}

    def reward_fn(prompts, completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        r = score(texts, answer)
        clock["rewards"] = r
        return r

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            clock["gen"] += time.perf_counter() - t
            return out

    class Steps(TrainerCallback):
        def on_train_begin(self, *a, **k):
            clock["t0"] = time.perf_counter()
            clock["last"] = clock["t0"]

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            r = clock.get("rewards", [])
            per_step.append({"t": now - clock["t0"], "samples": len(r), "wait_s": clock["gen"],
                             "step_s": now - clock["last"],
                             "reward": sum(r) / max(len(r), 1)})
            clock["gen"], clock["last"] = 0.0, now

    n = w["group_size"] * w["batch_groups"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), use_cpu=True, report_to=[],
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=w["group_size"],
        max_completion_length=w["max_new_tokens"], temperature=w["temperature"], top_p=1.0, top_k=0,
        learning_rate=w["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=w["grad_clip"], beta=0.0, epsilon=w["clip_eps"], loss_type="dapo",
        num_iterations=1, max_steps=w["steps"], shuffle_dataset=False, seed=w["seed"],
        logging_steps=1, save_strategy="no", bf16=False, disable_tqdm=True)
    trainer = Timed(model=model, processing_class=tok, reward_funcs=reward_fn, args=args,
                    train_dataset=ds, callbacks=[Steps()])
    trainer.train()
    return {"steps": per_step, "train_s": per_step[-1]["t"] if per_step else 0.0}


def run_loop(w: dict, threads: int) -> dict:
    """The floor: relax's own pieces (HF engine, scorer, GRPO advantages, shared-prefix
    trainer step) called one after the other in one process, one model, no bus."""
    from relax.trainer.loop import cpu_usage

    p = loop_parts(w, threads, "loop")
    per_step, first_step_at = [], None
    t0 = time.perf_counter()
    for step in range(w["steps"]):
        ts = time.perf_counter()
        groups = p.sample(step)
        wait = time.perf_counter() - ts
        before = resource.getrusage(resource.RUSAGE_SELF)
        stats = p.train(groups)
        now = time.perf_counter()
        rew = [x for g in groups for x in g.column("reward").to_pylist()]
        per_step.append({"t": now - t0, "samples": len(rew), "wait_s": wait,
                         "step_s": now - ts, "reward": sum(rew) / len(rew),
                         "train_s": stats["train_s"], "rows": stats["rows_computed"],
                         "tokens": stats["tokens_trained"],
                         **train_cpu(cpu_usage(before, resource.getrusage(resource.RUSAGE_SELF)))})
        first_step_at = first_step_at or time.time()
    return {"steps": per_step, "train_s": per_step[-1]["t"], "first_step_at": first_step_at}


class LoopParts:
    """One process's model, tokenizer, engine (on the same model) and prompts for
    workload ``w`` (:func:`loop_parts`), with the plain loop's two halves."""

    def __init__(self, w: dict, backend, tok, engine, rows: list[dict], rcfg, acfg):
        self.w, self.backend, self.tok, self.engine, self.rows = w, backend, tok, engine, rows
        self.rcfg, self.acfg = rcfg, acfg

    def sample(self, step: int) -> list:
        """Step ``step``'s groups: its ``batch_groups`` prompts (step modulo the
        workload's steps), sampled, scored and made into train samples
        (:func:`grpo_groups`)."""
        w, k = self.w, step % self.w["steps"]
        batch = self.rows[k * w["batch_groups"]:(k + 1) * w["batch_groups"]]
        return grpo_groups(self.engine, self.tok, batch, k, w, self.rcfg, self.acfg)[0]

    def train(self, groups: list) -> dict:
        """One optimizer step on the informative rows of ``groups`` (8192-token
        micro-batches); the back end's step statistics."""
        from relax.trainer.batching import informative_rows, loss_counts, micro_batches

        return self.backend.train_step(micro_batches(informative_rows(groups), 8192),
                                       counts=loss_counts(groups))


def loop_parts(w: dict, threads: int, engine_id: str) -> LoopParts:
    """The plain loop's pieces at ``threads`` torch threads, seeded by ``w["seed"]``:
    relax's torch back end and HF engine sharing one model, the first prompts of the
    workload (:func:`prompt_rows`)."""
    import torch

    from relax.consumers.engines.hf import HFEngine
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.config import TrainerConfig
    from relax.trainer.models import load_tokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(w["seed"])
    trainer, rcfg, acfg = loop_configs(w)
    backend = TorchBackend(TrainerConfig(**trainer))
    tok = load_tokenizer(w["model"])
    engine = HFEngine(backend.model, tok, engine_id=engine_id)
    return LoopParts(w, backend, tok, engine, prompt_rows(w), rcfg, acfg)


def loop_configs(w: dict, budget: int = 8192) -> tuple[dict, object, object]:
    """The settings the plain loop shares with relax's stages for workload ``w``.

    Args:
        w: the workload (:func:`workload`).
        budget: ``max_tokens_per_microbatch`` (padded tokens a micro-batch).

    Returns:
        ``(trainer, rollout, advantage)``: ``TrainerConfig`` keyword arguments (PPO-clip,
        token-mean, pi_old from the rollout), the ``RolloutConfig`` and the
        ``AdvantageConfig`` (GRPO, reward ``correct``).
    """
    from relax.consumers.aggregate_config import AdvantageConfig
    from relax.consumers.rollout.config import RolloutConfig

    trainer = dict(model=w["model"], batch_groups=w["batch_groups"], steps=w["steps"],
                   optim={"lr": w["lr"], "grad_clip": w["grad_clip"]},
                   loss={"policy_loss": "ppo_clip", "loss_agg_mode": "token-mean",
                         "clip_eps_low": w["clip_eps"], "clip_eps_high": w["clip_eps"]},
                   old_logprobs="rollout", max_tokens_per_microbatch=budget)
    rollout = RolloutConfig(run="loop",
                            dataset="arith", model=w["model"], group_size=w["group_size"],
                            max_new_tokens=w["max_new_tokens"], temperature=w["temperature"])
    return trainer, rollout, AdvantageConfig(estimator="grpo", rewards={"correct": 1.0})


def grpo_groups(engine, tok, batch: list[dict], step: int, w: dict, rcfg, acfg
                ) -> tuple[list, dict]:
    """One step of the plain loop's sampling: each prompt row of ``batch`` rendered with
    the chat template, ``group_size`` samples of each in one engine call, scored, made
    into train samples with GRPO advantages (the rollout, reward and aggregate stages'
    own functions, called in a row).

    Args:
        engine: a :class:`relax.consumers.engines.base.Engine` (HF engine, any device).
        tok: its tokenizer.
        batch: ``batch_groups`` source rows (``w["prompt_field"]``, ``w["label_field"]``).
        step: the step number (seeds the call, names the groups).
        w: the workload (:func:`workload`).
        rcfg, acfg: the rollout's ``RolloutConfig`` and the ``AdvantageConfig``.

    Returns:
        ``(groups, timing)``: one ``train_samples`` table per group; timing holds
        ``gen_s`` (the engine call, seconds) and ``gen_tokens`` (response tokens made).
    """
    import pyarrow as pa

    from relax.consumers.engines.base import SamplingParams
    from relax.consumers.multiturn import render_ids
    from relax.consumers.rollout.sampling import rollout_batch, sample_groups
    from relax.consumers.samples import build_train_samples

    ids = [render_ids(tok, [{"role": "user", "content": w["prompt_template"].format(
        prompt=r[w["prompt_field"]])}]) for r in batch]
    # seeded as the rollout stage seeds a call: seed + its group counter, counted
    # with the call's own groups (so relax sync samples exactly what the loop does)
    params = SamplingParams(max_new_tokens=w["max_new_tokens"], temperature=w["temperature"],
                            seed=w["seed"] + (step + 1) * w["batch_groups"])
    t = time.perf_counter()
    episodes = sample_groups(engine, ids, w["group_size"], params)
    timing = {"gen_s": time.perf_counter() - t,
              "gen_tokens": sum(len(e.response_ids) for eps in episodes for e in eps)}
    groups = []
    for gi, (r, eps) in enumerate(zip(batch, episodes)):
        prow = {"prompt_id": f"p{step}-{gi}", "dataset": "arith", "prompt": r[w["prompt_field"]],
                "label": str(r[w["label_field"]]), "metadata": "{}"}
        table = pa.Table.from_batches([rollout_batch(prow, f"g{step}-{gi}", eps, rcfg, "loop",
                                                     0, 0)])
        rewards = score([e.response_text for e in eps], [prow["label"]] * len(eps))
        cells = {f"g{step}-{gi}/{k}": {"correct": (v, None)} for k, v in enumerate(rewards)}
        groups.append(build_train_samples(table, cells, None, acfg))
    return groups, timing


def train_cpu(m: dict) -> dict:
    """A step's trainer CPU seconds (user + kernel) and minor page faults from its metrics."""
    return {"cpu_s": m.get("train_cpu_user_s", 0.0) + m.get("train_cpu_sys_s", 0.0),
            "faults": m.get("train_page_faults", 0.0)}


def run_relax(w: dict, mode: str, staleness: int, threads: int, run_root: str,
              shm: bool = True, bootstrap: str | None = None,
              fetch_wait_ms: int | None = None, trainer_processes: int = 1) -> dict:
    """``relax train`` on the demo recipe (every stage its own process, the run's own
    local Kafka or the cluster at ``bootstrap``); ``shm=False`` sends the weights by the
    gloo broadcast (``trainer.weights_shm``); ``fetch_wait_ms``: ``bus.fetch_wait_ms``
    (None: default); ``trainer_processes``: ``resources.trainer.processes``
    (data-parallel ranks, each at the stage's torch threads)."""
    import yaml

    from relax.infra.control.launch import train
    from relax.infra.observe.report import step_rows
    from relax.infra.recipe.recipe import load_recipe

    tree = yaml.safe_load(RECIPE.read_text())
    tree.update(mode=mode, run=f"bench-{mode}{staleness}-{time.strftime('%H%M%S')}",
                run_root=run_root, eval=None)
    tree["data"].update(limit=w["steps"] * w["batch_groups"], partitions=1)
    tree["rollout"]["seed"] = w["seed"]
    tree["trainer"].update(steps=w["steps"], max_staleness=staleness, weights_shm=shm)
    tree["bootstrap_servers"] = bootstrap
    if fetch_wait_ms is not None:
        tree.setdefault("bus", {})["fetch_wait_ms"] = fetch_wait_ms
    tree["trainer"]["loss"].update(clip_eps_low=w["clip_eps"], clip_eps_high=w["clip_eps"])
    for stage in ("rollout", "trainer"):
        tree["resources"][stage]["torch_threads"] = threads
    tree["resources"]["trainer"]["processes"] = trainer_processes
    recipe = load_recipe(None, [], tree=tree)
    summary = train(recipe, say=lambda s: print(s, flush=True))
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def ts(r):
        return datetime.fromisoformat(r["ts"]).timestamp()

    t0 = summary["train_started_at"]
    ends = {int(r["policy_version"]): ts(r) - t0 for r in rows
            if r["component"] == "trainer" and r["name"] == "step_s"}
    per_step = [{"t": ends[int(s["step"])], "samples": s["samples_trained"],
                 "wait_s": s["data_wait_s"], "step_s": s["step_s"],
                 "reward": s["reward_mean_trained"], "train_s": s["train_s"],
                 "checkpoint_s": s.get("checkpoint_s", 0.0), "rows": s.get("rows_computed"),
                 "tokens": s.get("tokens_trained"),
                 **train_cpu(s)}
                for s in step_rows(rows)]
    # rollout idle: its cumulative weight + budget waits between the ends of steps 1 and N-1
    # (its last batch is made during step N-1: after that it has nothing left to do)
    lo, hi = per_step[0]["t"], per_step[max(0, len(per_step) - 2)]["t"]
    waits: dict[float, float] = {}
    for r in rows:
        if r["component"].startswith("rollout") and r["name"] in ("weight_wait_s",
                                                                   "budget_wait_s"):
            t = ts(r) - t0
            waits[t] = waits.get(t, 0.0) + r["value"]
    inside = sorted((t, v) for t, v in waits.items() if lo <= t <= hi)
    rollout_idle = ((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
                    if len(inside) >= 2 and inside[-1][0] > inside[0][0] else None)
    return {"steps": per_step, "train_s": per_step[-1]["t"], "rollout_idle_frac": rollout_idle,
            "run_dir": str(run_dir), "first_step_at": t0 + min(ends.values()),
            "startup_laps_s": summary.get("startup_s"),
            "accounting": {k: summary.get(k) for k in ("sampled", "trained", "stale", "filtered",
                                                         "errors")}}


def one(system: str, w: dict, threads: int, out: Path, bootstrap: str | None = None,
        fetch_wait_ms: int | None = None, trainer_processes: int = 1) -> None:
    """Run one system and write its raw result to ``out``; relax systems on the cluster at
    ``bootstrap`` (None: the run starts its own local Kafka, as ``relax train`` does).
    ``first_step_s``: seconds from here (this process, its imports done) to the end of the
    system's first optimizer step (the loop and relax; TRL's is not taken)."""
    t0, begin = time.perf_counter(), time.time()
    if system == "trl":
        res = run_trl(w, threads)
    elif system.startswith("loop"):
        res = run_loop(w, threads)
    else:
        name = system.removesuffix("gloo")
        mode, s = (("sync", 0) if name.startswith("sync") else ("colocate", 0)
                   if name == "colocate" else ("async", int(name[-1])))
        with tempfile.TemporaryDirectory(prefix="relax-bench-") as d:
            res = run_relax(w, mode, s, threads, d, shm=not system.endswith("gloo"),
                            bootstrap=bootstrap, fetch_wait_ms=fetch_wait_ms,
                            trainer_processes=trainer_processes)
            png = Path(res.pop("run_dir")) / "timeline.png"  # the stages' CPU use
            if png.exists():
                shutil.copy(png, out.parent / f"{out.stem.replace('raw_', 'timeline_')}.png")
    res["wall_s"] = time.perf_counter() - t0
    at = res.pop("first_step_at", None)
    res["first_step_s"] = None if at is None else at - begin
    out.write_text(json.dumps(res))


# ------------------------------------------------------------------ the comparison
THREADS = {"trl": 2, "loop": 2, "loop1t": 1, "sync": 2, "sync1t": 1, "async1": 1, "async2": 1,
           "syncgloo": 2, "loop1tx2": 1, "colocate": 2}
"""torch threads per process. A single process, and relax sync whose stages take turns,
use both cores; the overlapped relax async stages get one each (two would fight).
``sync1t``: relax sync with async's per-stage threads (the same resources section);
``loop1t``: the plain loop at one thread (for :func:`derived_limit`);
``syncgloo``: relax sync with the weights sent by the gloo broadcast, not /dev/shm;
``colocate``: relax colocate, the rollout and the trainer taking turns in one process on
the same parameters (both cores, as the loop);
``loop1tx2``: two ``loop1t`` processes at once (each half's time while the other core is
busy too, for :func:`derived_limit`; samples/s is the two together)."""


def summarise(raw: dict) -> dict:
    """Rates, waits and the reward curve of one system's raw per-step result."""
    st = raw["steps"]
    samples = sum(s["samples"] for s in st)
    rest = st[1:] or st
    ckpt = sum(s.get("checkpoint_s", 0.0) for s in rest)  # relax only: the loop writes none
    window = (st[-1]["t"] - st[0]["t"] if len(st) > 1 else st[0]["t"]) - ckpt
    step_total = sum(s["step_s"] for s in rest) - ckpt
    wait = sum(s["wait_s"] for s in rest)
    idle = raw.get("rollout_idle_frac")
    rows = (sum(s["rows"] for s in rest)  # a step may train none (all groups zero-variance)
            if all(s.get("rows") is not None for s in rest) else None)
    if idle is None and "rollout_idle_frac" not in raw:  # one process: idle while training
        idle = (step_total - wait) / step_total
    return {
        "trained_samples": samples, "steps": len(st), "wall_s": round(raw["wall_s"], 1),
        "train_s": round(raw["train_s"], 1),
        "samples_per_s": round(samples / raw["train_s"], 3),
        "steady_samples_per_s": round(sum(s["samples"] for s in rest) / window, 3),
        "step_s_mean": round(step_total / len(rest), 2),
        "wait_s_mean": round(wait / len(rest), 2),
        "train_s_mean": round(sum(s.get("train_s", s["step_s"] - s["wait_s"])
                                  for s in rest) / len(rest), 2),
        "data_wait_pct": round(100 * wait / step_total, 1),
        "checkpoint_s": round(ckpt, 2),
        # training per row trained (the halves differ in informative rows across systems),
        # and the trainer's CPU seconds per wall second of training
        "rows_mean": None if rows is None else round(rows / len(rest), 1),
        "train_ms_per_row": (round(1000 * sum(s["train_s"] for s in rest) / rows, 1)
                             if rows else None),
        "train_cpu_per_s": (round(sum(s["cpu_s"] for s in rest)
                                  / sum(s["train_s"] for s in rest), 2)
                            if all("cpu_s" in s for s in rest) else None),
        "train_faults_per_row": (round(sum(s.get("faults", 0) for s in rest) / rows)
                                 if rows else None),
        "rollout_idle_pct": None if idle is None else round(100 * idle, 1),
        "reward_mean": round(sum(s["reward"] * s["samples"] for s in st) / samples, 4),
        "reward_curve": [round(s["reward"], 4) for s in st],
        "wait_s_curve": [round(s["wait_s"], 2) for s in st],
        # the trainer's own seconds a step (step less data-wait and checkpoint): the input
        # of relax.benchmarks.wait_floor
        "own_s_curve": [round(s["step_s"] - s["wait_s"] - s.get("checkpoint_s", 0.0), 3)
                        for s in st],
        **({"accounting": raw["accounting"]} if "accounting" in raw else {}),
        "first_step_s": (None if raw.get("first_step_s") is None
                         else round(raw["first_step_s"], 1)),
        **({"startup_laps_s": raw["startup_laps_s"]} if raw.get("startup_laps_s") else {}),
    }


def derived_limit(res: dict, one: str = "loop1t", rows_of: str | None = None) -> dict | None:
    """The best a perfect overlap of generation and training could do on 2 cores, from
    the plain loop's steady per-step times at two threads (``g2`` generation and scoring,
    ``t2`` training) and at one (``g1``, ``t1``): the two halves of consecutive steps run
    side by side on a core each, and when the shorter one ends, the longer one takes both
    cores. With ``t1 >= g1`` a step then takes ``g1 + (1 - g1 / t1) * t2`` seconds (else
    the same with g and t swapped); the limit is the loop's samples per step over that.
    ``one="loop1tx2"`` takes g1 and t1 from two one-thread loops run at once instead (the
    halves as fast as they run while the other core works: cores that slow each other
    down lower the limit). ``rows_of`` (a relax system) scales each loop's training time
    to that system's trained rows per step (``rows_mean``): the systems sample different
    answers, so their steps hold different numbers of informative rows, and this limit is
    the one for the rows that system actually trained. None without both loops."""
    if "loop" not in res or one not in res or (rows_of and rows_of not in res):
        return None
    if rows_of and not (res[rows_of]["rows_mean"] and res["loop"]["rows_mean"]
                        and res[one]["rows_mean"]):
        return None  # rows unknown, or none trained
    g2, t2 = res["loop"]["wait_s_mean"], res["loop"]["train_s_mean"]
    g1, t1 = res[one]["wait_s_mean"], res[one]["train_s_mean"]
    if rows_of:
        rows = res[rows_of]["rows_mean"]
        t2, t1 = t2 * rows / res["loop"]["rows_mean"], t1 * rows / res[one]["rows_mean"]
    (a1, _a2), (b1, b2) = sorted([(g1, g2), (t1, t2)])  # a: the shorter half at 1 thread
    step = a1 + (1 - a1 / b1) * b2
    per_step = res["loop"]["trained_samples"] / res["loop"]["steps"]
    return {"g1_s": g1, "t1_s": round(t1, 2), "g2_s": g2, "t2_s": round(t2, 2),
            "step_s": round(step, 2),
            "samples_per_s": round(per_step / step, 3),
            "sequential_2thread_step_s": round(g2 + t2, 2)}


def corun(results: list[dict]) -> dict:
    """One summary of two loops run at once: their samples/s added, the per-step means
    (``*_mean`` seconds) averaged (each half's time while the other core is busy too);
    every other figure is the first loop's."""
    a, b = results
    out = {k: round((a[k] + b[k]) / 2, 2) if isinstance(a[k], float) and k.endswith("_mean")
           else a[k] for k in a}
    for k in ("samples_per_s", "steady_samples_per_s"):
        out[k] = round(a[k] + b[k], 3)
    return out


def wait_floors(res: dict, best_async: str) -> dict:
    """``trainer_data_wait_floor``: the best async system's data-wait share (a fraction,
    as ``trainer_data_wait``) that its staleness bound forces with perfect hand-offs
    (:func:`relax.benchmarks.wait_floor.floor_pct`), on its own training times and the
    one-thread loop's generation time per step measured with the other core busy
    (``loop1tx2``; else ``loop1t`` alone, ``wait_floor_from``); ``wait_floor_gen_s``:
    that generation time. Empty without both."""
    one = next((k for k in ("loop1tx2", "loop1t") if k in res), None)
    if one is None or best_async not in res or "own_s_curve" not in res[best_async]:
        return {}
    gen = res[one]["wait_s_mean"]
    pct = floor_pct(res[best_async]["own_s_curve"], gen, int(best_async[-1]))
    return {"trainer_data_wait_floor": round(pct / 100, 4), "wait_floor_gen_s": gen,
            "wait_floor_from": one}


def ratios(res: dict) -> dict:
    """Ratios of steady samples/s (and of end-to-end samples/s, ``*_e2e``)."""
    def r(a, b, key="steady_samples_per_s"):
        if a in res and b in res:
            return round(res[a][key] / res[b][key], 3)
        return None

    best_async = max((k for k in ("async1", "async2") if k in res),
                     key=lambda k: res[k]["steady_samples_per_s"], default="async1")
    out = {"async_over_sync": r(best_async, "sync"), "async_over_sync_1thread": r(best_async, "sync1t"),
           "async_over_loop": r(best_async, "loop"), "relax_over_trl": r(best_async, "trl"),
           "sync_over_loop": r("sync", "loop"), "loop_over_trl": r("loop", "trl"),
           "sync_over_loop_1thread": r("sync1t", "loop1t"),
           "colocate_over_loop": r("colocate", "loop"),
           "async_over_sync_e2e": r(best_async, "sync", "samples_per_s"),
           "relax_over_trl_e2e": r(best_async, "trl", "samples_per_s"),
           "best_async": best_async}
    limit = derived_limit(res)
    out["limit"] = limit
    out["async_over_limit"] = (round(res[best_async]["steady_samples_per_s"]
                                     / limit["samples_per_s"], 3)
                               if limit and best_async in res else None)
    corun_limit = derived_limit(res, "loop1tx2")
    out["limit_corun"] = corun_limit
    out["async_over_limit_corun"] = (round(res[best_async]["steady_samples_per_s"]
                                           / corun_limit["samples_per_s"], 3)
                                     if corun_limit and best_async in res else None)
    rows_limit = derived_limit(res, rows_of=best_async)
    out["limit_rows"] = rows_limit
    out["async_over_limit_rows"] = (round(res[best_async]["steady_samples_per_s"]
                                          / rows_limit["samples_per_s"], 3)
                                    if rows_limit else None)
    out["trainer_data_wait"] = (round(res[best_async]["data_wait_pct"] / 100, 4)
                                if best_async in res else None)
    out.update(wait_floors(res, best_async))
    out.update(startup_over_loop(res))
    return out


def startup_over_loop(res: dict) -> dict:
    """``startup_over_loop_s``: relax sync's seconds to its first optimizer step less the
    plain loop's (each from its process's start; the first step's own work is about the
    same in both), and the same for ``colocate`` (``startup_colocate_over_loop_s``). None
    where a system is missing."""
    def over(name: str) -> float | None:
        a, b = (res.get(n, {}).get("first_step_s") for n in (name, "loop"))
        return None if a is None or b is None else round(a - b, 1)

    return {"startup_over_loop_s": over("sync"),
            "startup_colocate_over_loop_s": over("colocate")}


def plot(res: dict, path: Path) -> None:
    """Steady samples/s per system and the reward per step against trained samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = list(res)
    a.bar([SYSTEMS[n] for n in names], [res[n]["steady_samples_per_s"] for n in names])
    a.set_ylabel("trained samples / s (steady)")
    a.tick_params(axis="x", rotation=30)
    for n in names:
        per = res[n]["trained_samples"] / res[n]["steps"]
        b.plot([per * (i + 1) for i in range(res[n]["steps"])], res[n]["reward_curve"],
               marker="o", label=SYSTEMS[n])
    b.set_xlabel("trained samples")
    b.set_ylabel("mean reward of the step's samples")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per system")
    ap.add_argument("--systems", default="trl,loop,sync,sync1t,async1,async2")
    ap.add_argument("--out", default=str(RESULTS / "e2e_vs_trl.json"))
    ap.add_argument("--timeout-s", type=float, default=1800, help="per system")
    ap.add_argument("--seed", type=int, default=1,
                    help="sampling seed of every system (same prompts); runs at other seeds "
                         "give the spread of reward_mean")
    ap.add_argument("--bootstrap", default=None,
                    help="a cluster shared by the relax systems (default: each run starts "
                         "its own local Kafka, as relax train does)")
    ap.add_argument("--fetch-wait-ms", type=int, default=None,
                    help="the relax systems' bus.fetch_wait_ms (default: BusConfig's)")
    ap.add_argument("--trainer-processes", type=int, default=1,
                    help="the relax systems' resources.trainer.processes (data-parallel "
                         "trainer ranks)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--raw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    w = workload(args.steps, args.seed)
    if args.one:
        one(args.one, w, args.threads, Path(args.raw), args.bootstrap, args.fetch_wait_ms,
            args.trainer_processes)
        return
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; valid: {', '.join(SYSTEMS)}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results, t_all = {}, time.perf_counter()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    for name in systems:
        # another --out keeps its own files (the relax systems' timeline_<name>.png too)
        tag = name if out.stem == "e2e_vs_trl" else f"{name}_{out.stem}"
        raw = out.parent / f"raw_{tag}.json"
        log = out.parent / f"log_{tag}.txt"
        print(f"== {SYSTEMS[name]} ({THREADS[name]} torch threads per process)", flush=True)
        copies = 2 if name == "loop1tx2" else 1
        raws = [raw] if copies == 1 else [raw.with_suffix(f".{i}.json") for i in range(copies)]
        logs = [log] if copies == 1 else [log.with_suffix(f".{i}.txt") for i in range(copies)]
        procs = []
        for r, lg in zip(raws, logs):
            with lg.open("w") as f:
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--one", name.removesuffix("x2"), "--steps",
                     str(args.steps), "--seed", str(args.seed), "--threads", str(THREADS[name]),
                     "--raw", str(r),
                     *(["--bootstrap", args.bootstrap] if args.bootstrap else []),
                     "--trainer-processes", str(args.trainer_processes),
                     *(["--fetch-wait-ms", str(args.fetch_wait_ms)]
                       if args.fetch_wait_ms is not None else [])],
                    stdout=f, stderr=subprocess.STDOUT, env=env))
        for p, lg in zip(procs, logs):
            if p.wait(timeout=args.timeout_s) != 0:
                tail = lg.read_text()[-3000:]
                raise SystemExit(f"{name} failed (exit {p.returncode}); log {lg}:\n{tail}")
        each = [summarise(json.loads(r.read_text())) for r in raws]
        results[name] = each[0] if copies == 1 else corun(each)
        for f in raws + logs:
            f.unlink()
        r = results[name]
        print(f"   samples/s steady={r['steady_samples_per_s']} e2e={r['samples_per_s']} "
              f"step_s={r['step_s_mean']} data-wait={r['data_wait_pct']}% "
              f"rollout-idle={r['rollout_idle_pct']}% reward={r['reward_mean']} "
              f"wall_s={r['wall_s']}", flush=True)
    rat = ratios(results)
    doc = {"workload": w, "threads": {k: THREADS[k] for k in systems},
           "bus": {"broker": args.bootstrap or "own", "fetch_wait_ms": args.fetch_wait_ms},
           "trainer_processes": args.trainer_processes,
           "total_s": round(time.perf_counter() - t_all),
           "systems": results, **rat}
    write_result(out, doc)
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print(" ".join(f"{k}={v}" for k, v in rat.items()))


if __name__ == "__main__":
    main()

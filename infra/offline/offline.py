"""Offline work from a run archive (``relax archive``): training from archived train
samples, and recomputing a finished run's losses to find where it diverged.

* :func:`train_from_archive` (``relax train RECIPE --from-archive DIR``): the
  archived ``train_samples`` rows, in the order they were written (message time across
  partitions, then partition and offset), become batches of ``trainer.batch_groups``
  groups for the recipe's trainer, each step computed as the trainer stage computes it
  (:func:`relax.trainer.step_batch.step_batch`); no broker, no rollout. Rows with a
  ``drop_reason`` are skipped (they were never meant to be trained); staleness is not
  applied (offline data is as old as the archive). The live trainer took groups as they
  arrived and dropped stale ones, so a step's batch equals the live step's only where
  those orders agree. With ``--batches-from RUN_DIR`` it trains the live batches
  themselves, in their order (:func:`live_batches`, from the run's ledger), which
  reproduces the run's losses.
* :func:`recompute_losses` (``relax replay DIR --recompute-loss --run-dir RUN_DIR``):
  for every recorded step k, the rows the trainer's ledger says it trained at
  policy_version k-1 are loaded from the archive, the weights of version k-1 are
  loaded from the run's checkpoints (version 0 = the initial model), the loss is
  computed again on CPU with the run's loss settings and compared with the ``loss``
  metric recorded for step k; the first step that differs by more than the
  tolerance is reported.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from relax.infra.recipe.recipe import Recipe


def _archived_topic(archive_dir: str | Path, name: str) -> str:
    from relax.producers.archive import load_manifest

    found = [t for t in load_manifest(archive_dir)["topics"] if t.endswith("." + name)]
    if not found:
        raise ValueError(f"{archive_dir}: no archived '<run>.{name}' topic")
    return found[0]


def archived_rows(archive_dir: str | Path, name: str, *, write_order: bool = False) -> pa.Table:
    """Every archived row of the run's ``name`` topic (e.g. ``train_samples``), with its
    v1 schema: in archive order (partition by partition), or with ``write_order`` sorted
    by message time, partition and offset (the order the rows were written in).

    Raises:
        ValueError: the archive has no such topic.
    """
    from relax.producers.archive import iter_archive, strip_meta

    topic = _archived_topic(archive_dir, name)
    tables = list(iter_archive(archive_dir, topic))
    if not tables:
        from relax.schemas.v1 import get_schema

        return get_schema(name).empty_table()
    table = pa.concat_tables(tables)
    if write_order:
        table = table.sort_by([("_timestamp", "ascending"), ("_partition", "ascending"),
                               ("_offset", "ascending")])
    return strip_meta(table, name)


def _groups(table: pa.Table) -> list[pa.Table]:
    from relax.streams.codec import group_by_key

    return [g for _, g in group_by_key(table, "group_id")]


def live_batches(samples: pa.Table, run_dir: str | Path) -> dict[int, list[pa.Table]]:
    """The groups the run's trainer trained at each policy_version (its step
    policy_version + 1), from the ledger of the run's newest checkpoint, as rows of
    ``samples`` (the archived ``train_samples``; a row archived twice is taken once).

    Raises:
        ValueError: ``run_dir`` has no checkpoint with a ledger.
    """
    from relax.trainer import checkpoint
    from relax.trainer.ledger import Ledger

    ckpt = checkpoint.latest(Path(run_dir))
    if ckpt is None:
        raise ValueError(f"{run_dir}: no checkpoint (with its ledger)")
    by_version: dict[int, set[str]] = {}
    for rid, (outcome, version, _) in Ledger.load(ckpt / "ledger.parquet").items():
        if outcome == "trained":
            by_version.setdefault(version, set()).add(rid)
    out = {}
    for version, ids in sorted(by_version.items()):
        rows = samples.filter(pc.is_in(samples.column("rollout_id"),
                                       value_set=pa.array(sorted(ids))))
        out[version] = _groups(_dedup(rows))
    return out


def train_from_archive(recipe: Recipe, archive_dir: str, *, batches_from: str | None = None,
                       say: Callable[[str], None] = print) -> dict:
    """Train the recipe's model on the archive's train samples; returns a summary (also in
    ``<run_root>/<run>/summary.json``, with each step's ``losses``); the model goes to
    ``final_model``.

    Args:
        batches_from: the archived run's folder: train the batches its trainer trained, in
            its order (:func:`live_batches`), which reproduces its steps; None: batches of
            ``trainer.batch_groups`` groups in write order.

    Raises:
        ValueError: fewer trainable groups than one batch, or ``batches_from`` has no
            checkpoint with a ledger.
    """
    import time

    from relax.trainer import checkpoint
    from relax.trainer.backends import build_backend
    from relax.trainer.batching import micro_batches
    from relax.trainer.ledger import Ledger
    from relax.trainer.step_batch import step_batch

    t = recipe.trainer
    run_dir = Path(recipe.run_root) / recipe.run
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = archived_rows(archive_dir, "train_samples", write_order=True)
    keep = rows.filter(rows.column("drop_reason").is_null())
    if batches_from is not None:
        batches = list(live_batches(keep, batches_from).values())
    else:
        groups = _groups(keep)
        batches = [groups[i:i + t.batch_groups]
                   for i in range(0, len(groups) - t.batch_groups + 1, t.batch_groups)]
    steps = min(t.steps, len(batches))
    if steps == 0:
        raise ValueError(f"{archive_dir}: fewer trainable groups than one batch of "
                         f"{t.batch_groups}")
    backend = build_backend(t)
    ledger = Ledger()
    t0 = time.time()
    losses = []
    for step, batch in enumerate(batches[:steps]):
        prepared = step_batch(batch, t)
        stats = backend.train_step(micro_batches(prepared.trained, t.max_tokens_per_microbatch),
                                   counts=prepared.counts)
        for g in batch:
            for rid in g.column("rollout_id").to_pylist():
                ledger.record(rid, "trained", step)
        losses.append(float(stats["loss"]))
        say(f"offline step {step + 1}/{steps} loss={stats['loss']:.4f} "
            f"grad_norm={stats['grad_norm']:.3f} rows={sum(g.num_rows for g in batch)}")
    checkpoint.save(run_dir, backend, checkpoint.TrainerState(steps), ledger)
    backend.save_model(run_dir / "final_model")  # with trainer.lora: merged, and adapter/
    summary = {"run": recipe.run, "run_dir": str(run_dir), "steps": steps,
               "sampled": rows.num_rows, "trained": len(ledger), "stale": 0,
               "filtered": rows.num_rows - keep.num_rows, "errors": 0,
               "offline_from": str(archive_dir), "batches_from": batches_from,
               "losses": losses, "train_s": round(time.time() - t0, 1)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


@dataclass
class RecomputeReport:
    """Per-step ``(step, recorded loss, recomputed loss)``, the first step whose relative
    difference exceeds the tolerance (None if none), and the steps that could not be
    checked, each ``(step, why)``: its weights (the checkpoint of the version before)
    deleted by the trainer's retention, or no trained rows of it in the archive."""

    steps: list[tuple[int, float, float]] = field(default_factory=list)
    first_divergent: int | None = None
    skipped: list[tuple[int, str]] = field(default_factory=list)

    def skipped_line(self) -> str | None:
        """One line saying how many recorded steps were checked and, per reason, which
        were not (steps as ranges); None when every step was checked."""
        if not self.skipped:
            return None
        by_reason: dict[str, list[int]] = {}
        for step, why in self.skipped:
            by_reason.setdefault(why, []).append(step)
        parts = [f"{_ranges(steps)}: {why}" for why, steps in by_reason.items()]
        total = len(self.steps) + len(self.skipped)
        return (f"checked {len(self.steps)} of {total} recorded steps; not checked: "
                + "; ".join(parts))


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``steps 1-3, 7``."""
    out, start = [], None
    for i, s in enumerate(steps):
        if start is None:
            start = s
        if i + 1 == len(steps) or steps[i + 1] != s + 1:
            out.append(str(s) if s == start else f"{start}-{s}")
            start = None
    return ("step " if len(steps) == 1 else "steps ") + ", ".join(out)


def recompute_losses(archive_dir: str, run_dir: str, *, rtol: float = 1e-3,
                     atol: float = 1e-5) -> RecomputeReport:
    """Recompute every recorded step's loss from the archive and the run's checkpoints.

    Args:
        archive_dir: the run's archive (train_samples and metrics topics).
        run_dir: the run folder (``recipe.yaml``, ``checkpoints/step_*``).
        rtol / atol: a step diverges when |recorded - recomputed| > atol + rtol |recorded|.

    Raises:
        ValueError: no recorded losses, or no checkpoint with a ledger in ``run_dir``.
    """
    import torch

    from relax.infra.recipe.recipe import load_recipe
    from relax.trainer.backends.torch_backend import TorchBackend
    from relax.trainer.batching import micro_batches
    from relax.trainer.losses.aggregate import mask_counts
    from relax.trainer.losses.registry import compute_policy_loss

    run_dir_p = Path(run_dir)
    recipe = load_recipe(run_dir_p / "recipe.yaml")
    t = recipe.trainer
    metrics = archived_rows(archive_dir, "metrics").to_pylist()
    recorded = {int(r["policy_version"]): r["value"] for r in metrics
                if r["component"] == "trainer" and r["name"] == "loss"}
    if not recorded:
        raise ValueError(f"{archive_dir}: no recorded trainer loss")
    batches = live_batches(archived_rows(archive_dir, "train_samples"), run_dir_p)
    backend = TorchBackend(t)
    report = RecomputeReport()
    for step in sorted(recorded):
        groups = batches.get(step - 1)
        weights = run_dir_p / "checkpoints" / f"step_{step - 1:06d}"
        if not groups:
            report.skipped.append((step, "no rows it trained in the archive"))
            continue
        if step > 1 and not weights.exists():
            report.skipped.append((step, f"the checkpoint of the version before is gone "
                                  f"(the trainer keeps the newest {t.keep_checkpoints}: "
                                  f"trainer.keep_checkpoints, checkpoint_every "
                                  f"{t.checkpoint_every})"))
            continue
        if step > 1:
            backend.load(weights)
        else:
            backend = TorchBackend(t)
        mbs = micro_batches(groups, t.max_tokens_per_microbatch)
        counts = [mask_counts(mb.loss_mask) for mb in mbs]
        tokens, seqs = sum(c[0] for c in counts), sum(c[1] for c in counts)
        total = 0.0
        with torch.no_grad():
            for mb in mbs:
                lp, ent = backend.logprobs(mb, with_entropy=t.loss.entropy_coef != 0)
                old = mb.rollout_logprobs if t.old_logprobs == "rollout" else lp
                loss, _ = compute_policy_loss(t.loss, lp, old, mb.advantages, mb.loss_mask,
                                              rollout_logprobs=mb.rollout_logprobs,
                                              ref_logprobs=mb.ref_logprobs, entropy=ent,
                                              global_tokens=max(tokens, 1), global_seqs=max(seqs, 1))
                total += float(loss)
        rec = float(recorded[step])
        report.steps.append((step, rec, total))
        if report.first_divergent is None and abs(rec - total) > atol + rtol * abs(rec):
            report.first_divergent = step
    return report


def _dedup(rows: pa.Table) -> pa.Table:
    seen, keep = set(), []
    for i, rid in enumerate(rows.column("rollout_id").to_pylist()):
        if rid not in seen:
            seen.add(rid)
            keep.append(i)
    return rows.take(pa.array(keep)) if len(keep) < rows.num_rows else rows

"""Offline work on a finished tiny run: recompute its losses from the archive, and train
from the archive without a broker."""

from __future__ import annotations

import pytest

from relax.infra.offline.offline import recompute_losses, train_from_archive
from relax.producers.archive import archive_run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def archived(tiny_run, broker, tmp_path_factory):
    from relax.streams.client import BusConfig

    recipe, summary = tiny_run
    out = tmp_path_factory.mktemp("archive")
    archive_run(BusConfig(bootstrap_servers=broker), recipe.run, out)
    return recipe, summary, out


def test_recompute_loss_matches_every_recorded_step(archived):
    recipe, summary, out = archived
    rep = recompute_losses(str(out), summary["run_dir"])
    assert [s for s, _, _ in rep.steps] == [1, 2, 3] and rep.skipped == []
    assert rep.first_divergent is None, rep.steps


def test_recompute_loss_reports_the_first_divergent_step(archived, tmp_path):
    """Tamper with the weights used for step 2: step 2 must be reported, not step 1."""
    import shutil
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file

    recipe, summary, out = archived
    run_dir = tmp_path / "run"
    shutil.copytree(summary["run_dir"], run_dir)
    f = next((run_dir / "checkpoints" / "step_000001").glob("*.safetensors"))
    w = load_file(f)
    k = next(k for k in w if k.endswith("mlp.down_proj.weight"))
    w[k] = w[k] + 0.05 * torch.randn_like(w[k])
    save_file(w, f, metadata={"format": "pt"})
    rep = recompute_losses(str(out), str(run_dir))
    assert rep.first_divergent == 2, rep.steps
    assert Path(summary["run_dir"]).exists()


def test_recompute_loss_says_which_steps_it_could_not_check_and_why(archived, tmp_path):
    """A long run keeps only its newest checkpoints: the steps whose weights are gone are
    named with the reason, and the others are still checked."""
    import shutil

    recipe, summary, out = archived
    run_dir = tmp_path / "run"
    shutil.copytree(summary["run_dir"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_000001")
    rep = recompute_losses(str(out), str(run_dir))
    assert [s for s, _, _ in rep.steps] == [1, 3] and rep.first_divergent is None
    assert [s for s, _ in rep.skipped] == [2]
    line = rep.skipped_line()
    assert line.startswith("checked 2 of 3 recorded steps; not checked: step 2: the "
                           "checkpoint of the version before is gone"), line
    assert "trainer.keep_checkpoints" in line


def test_train_from_archive(archived, tmp_path):
    from relax.infra.recipe.recipe import load_recipe

    recipe, summary, out = archived
    rec = load_recipe(tree=recipe.model_dump(mode="json") | {"run": "offline1",
                                                              "run_root": str(tmp_path)},
                      overrides=["trainer.steps=2"])
    lines = []
    s = train_from_archive(rec, str(out), say=lines.append)
    assert s["steps"] == 2 and len(lines) == 2 and "loss=" in lines[0]
    assert (tmp_path / "offline1" / "final_model" / "model.safetensors").exists()


def test_train_from_archive_with_the_live_batches_reproduces_the_runs_losses(archived, tmp_path):
    """The trainer's batches (its ledger), each step computed as the stage computes it:
    every step's loss is the live one, to float noise."""
    import json
    from pathlib import Path

    from relax.infra.recipe.recipe import load_recipe

    recipe, summary, out = archived
    rec = load_recipe(tree=recipe.model_dump(mode="json") | {"run": "offline2",
                                                              "run_root": str(tmp_path)})
    s = train_from_archive(rec, str(out), batches_from=summary["run_dir"], say=lambda _: None)
    rows = [json.loads(x) for x in (Path(summary["run_dir"]) / "metrics.jsonl").read_text()
            .splitlines()]
    live = [r["value"] for r in sorted((r for r in rows if r["component"] == "trainer"
                                        and r["name"] == "loss"),
                                       key=lambda r: r["policy_version"])]
    assert s["steps"] == len(live) == 3
    assert s["losses"] == pytest.approx(live, rel=1e-4, abs=1e-6), (s["losses"], live)

"""PPO with a critic through the broker (tiny model): ``advantage.estimator: gae`` trains
the critic in the trainer process, the trainer is killed once after step 2's checkpoint
and resumes with its critic, every rollout is accounted for."""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
import torch
from testdata import kill_when, tiny_recipe

from relax.schemas import metric_names as M
from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.trainer import checkpoint
from relax.trainer.ledger import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]


def test_tiny_ppo_run_trains_the_critic_and_survives_a_trainer_kill(broker, tmp_path):
    from relax.infra.control.launch import train

    run = "ppo" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "advantage.estimator=gae",
                         "advantage.estimator_options={gamma: 1.0, lam: 0.95}",
                         "trainer.critic.optim.lr=1e-3")
    assert recipe.trainer.critic is not None
    run_dir = tmp_path / run
    state = run_dir / "checkpoints" / "step_000002" / checkpoint.STATE_FILE
    with kill_when(state.exists,
                   lambda: [json.loads((run_dir / "stages.json").read_text())["trainer"]["pid"]],
                   poll_s=0.05) as killed:
        s = train(recipe, say=lambda _: None, timeout_s=500)
    assert len(killed) == 1, killed
    assert s["steps"] == 3 and s["balanced"], json.dumps(s, default=str)
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "resumed from" in log and "policy_version 2" in log
    last = checkpoint.latest(run_dir)
    assert last.name == "step_000003"
    assert len(Ledger.load(last / "ledger.parquet").ids("trained")) == s["trained"]
    # the critic came back with the trainer: 3 critic steps in all (a critic restarted
    # from scratch after the kill would count 1)
    opt = torch.load(last / checkpoint.CRITIC_DIR / "optimizer.pt", weights_only=True)
    assert opt["steps_done"] == 3 and opt["optimizer"]["state"]
    # value-loss metrics of every step on the bus
    rows = read_table(BusConfig(bootstrap_servers=broker), f"{run}.metrics").to_pylist()
    got = {(r["policy_version"], r["name"]): r["value"] for r in rows
           if r["component"] == "trainer"}
    for v in (1, 2, 3):
        for name in (M.VALUE_LOSS, M.VF_CLIP_FRAC, M.VALUE_MEAN, M.RETURN_MEAN,
                     M.CRITIC_GRAD_NORM):
            assert math.isfinite(got[(v, name)]), (v, name, got.get((v, name)))
    # step 1: the zero head predicts 0, so the loss is 0.5 * mean(return^2) > 0 unless every
    # parity reward of the step was 0; later steps' values move off 0
    assert got[(1, M.VALUE_MEAN)] == 0.0
    assert got[(1, M.VALUE_LOSS)] > 0 or got[(1, M.RETURN_MEAN)] == 0
    assert got[(3, M.VALUE_MEAN)] != 0.0
    # the critic next to the final model, loadable with transformers
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(Path(s["run_dir"]) / "critic")
    assert critic.config.num_labels == 1

"""Colocated mode (``mode: colocate``, :mod:`relax.infra.control.colocate`): the trainer and one HF
rollout engine in one process on the same parameter tensors, the rewards, the aggregate
and the ledger as in the other modes, strictly on-policy."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from testdata import assert_on_policy, tiny_recipe

from relax.consumers.engines.base import SamplingParams
from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.infra.control.chaos import Kill, chaos_run
from relax.infra.recipe.sections import RecipeError
from relax.infra.recipe.specs import stage_specs

STEPS = 4
BATCH_GROUPS = 2
GROUP_SIZE = 4


def _colocate_spec(broker: str, tmp_path: Path, run: str, *overrides: str):
    recipe = tiny_recipe(broker, tmp_path, run, "mode=colocate", *overrides)
    run_dir = tmp_path / run
    specs = stage_specs(recipe, run_dir)
    return recipe, specs


def test_colocate_makes_one_process_of_rollout_and_trainer(broker, tmp_path):
    recipe, specs = _colocate_spec(broker, tmp_path, "c")
    assert recipe.max_staleness == recipe.rollout.max_staleness == recipe.trainer.max_staleness == 0
    kinds = {s.name: s.kind for s in specs}
    assert kinds["trainer"] == "colocate" and not any(n.startswith("rollout") for n in kinds)
    config = specs[-1].config
    assert config["rollout"]["follow_weights"] is False and config["rollout"]["max_staleness"] == 0
    assert config["trainer"]["publish_weights"] is False  # no other stage takes weights


@pytest.mark.parametrize("override", [
    'eval={source: "reasoning_gym:basic_arithmetic?size=40", every: 2, '
    'reward: {name: e, fn: "testdata:parity_reward"}}',
    "reference.follow_every=2"], ids=["eval", "following-reference"])
def test_a_colocated_trainer_sends_weights_when_a_stage_subscribes(broker, tmp_path, override):
    _, specs = _colocate_spec(broker, tmp_path, "c", "kl.coef=0.01", "kl.in=loss", override)
    assert specs[-1].config["trainer"]["publish_weights"] is True


@pytest.mark.parametrize("override, key", [
    ("rollout.instances=2", "rollout.instances"),
    ("max_staleness=1", "max_staleness"),
    ("rollout.engine=sglang", "rollout.engine"),
    ("resources.trainer.processes=2", "resources.trainer.processes"),
])
def test_colocate_refuses_what_it_cannot_run(broker, tmp_path, override, key):
    with pytest.raises(RecipeError, match=f"mode 'colocate' needs {key} "):
        tiny_recipe(broker, tmp_path, "c", "mode=colocate", override)


def test_the_engine_generates_with_the_trainers_parameters(broker, bus, tmp_path):
    from relax.infra.control.colocate import ColocateConfig, ColocatedStage

    _, specs = _colocate_spec(broker, tmp_path, "c" + uuid.uuid4().hex[:6])
    stage = ColocatedStage(ColocateConfig(**specs[-1].config), bus)
    try:
        model = stage.trainer.backend.model
        assert stage.engine.model is model
        engine_ptrs = {n: p.data_ptr() for n, p in stage.engine.model.named_parameters()}
        trainer_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        assert engine_ptrs == trainer_ptrs and len(engine_ptrs) > 0
        assert model.training  # the trainer's mode between generate calls
        assert stage.engine.policy_version == stage.trainer.version == 0
        tok = stage.engine.tokenizer
        out = stage.engine.generate([tok.encode("1 + 2 =")],
                                    SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
        assert len(out) == 1 and out[0].policy_version_start == 0 and model.training
        # a change to the trainer's parameters is the engine's at once: no copy, no swap
        p = next(model.parameters())
        with stage.lock:
            p.data.add_(1.0)
        assert next(stage.engine.model.parameters()).data_ptr() == p.data_ptr()
        stage.engine.set_version(1)
        assert stage.engine.policy_version == 1
        with pytest.raises(ValueError, match="older"):
            stage.engine.set_version(0)
    finally:
        stage.trainer.close()


@pytest.mark.e2e
@pytest.mark.usefixtures("local_ray")
def test_colocated_run_trains_every_sample_on_policy(broker, tmp_path):
    from relax.infra.control.launch import train

    run = "coloc" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "mode=colocate", f"trainer.steps={STEPS}",
                         f"batch_groups={BATCH_GROUPS}", f"rollout.group_size={GROUP_SIZE}",
                         "trainer.keep_checkpoints=10")
    lines: list[str] = []
    s = train(recipe, say=lines.append, timeout_s=500)
    assert s["steps"] == STEPS and s["balanced"], (s, lines)
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    assert s["stale"] == 0, s
    stages = json.loads((Path(s["run_dir"]) / "stages.json").read_text())
    assert stages["trainer"]["kind"] == "colocate" and "rollout-0" not in stages, stages
    # no other process takes the weights: versions announced, no bytes, no snapshot
    rows = read_table(BusConfig(bootstrap_servers=broker), f"{run}.weights").to_pylist()
    assert [(r["policy_version"], r["transport"]) for r in rows] == [
        (v, "version") for v in range(STEPS + 1)]
    assert not any((Path(s["run_dir"]) / "weights").glob("v*"))

    assert_on_policy(s, broker, run, STEPS, BATCH_GROUPS, GROUP_SIZE)


@pytest.mark.e2e
@pytest.mark.usefixtures("local_ray")
def test_a_killed_colocated_stage_resumes_with_nothing_lost(broker, tmp_path):
    recipe = tiny_recipe(broker, tmp_path, "colocchaos" + uuid.uuid4().hex[:6],
                         "mode=colocate", "trainer.steps=5")
    r = chaos_run(recipe, [Kill("trainer", 2, 0.0)], 500)
    detail = json.dumps(r.as_dict(), default=str)[:3000]
    assert r.killed and r.finished, detail
    assert r.lost == 0 and r.trained_twice == 0, detail
    # the restarted stage's engine starts at the checkpoint's version, which is saved
    # before the step's groups are granted: nothing in flight is stale
    assert r.stale == 0, detail
    assert r.trained + r.stale + r.filtered + r.errors == r.sampled > 0, detail

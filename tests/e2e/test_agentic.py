"""The agentic recipes (issue 16) run end to end with the tiny model: multi-turn rollouts
with a tool environment whose reward is a real reward on ``<run>.rewards`` (written by
the rollout stage under the recipe's ``fn: environment`` reward; no reward stage runs),
joined and counted by the aggregator. Every stage its own process, the real broker."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from testdata import RECIPES

from relax.streams.client import BusConfig
from relax.streams.read import read_table

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]

TINY = ("model=tiny-llama", "trainer.steps=2", "rollout.group_size=4",
        "rollout.groups_per_generate=2", "trainer.batch_groups=2", "trainer.num_threads=1")


@pytest.mark.parametrize("recipe_name, reward, overrides", [
    ("calc_tool_grpo", "correct", ("rollout.max_new_tokens=16",)),
    ("humaneval_sandbox", "tests_pass", ("rollout.max_new_tokens=24",
                                         "rollout.max_total_tokens=96")),
])
def test_agentic_recipe_with_the_tiny_model(broker, tmp_path, recipe_name, reward, overrides):
    from relax.infra.control.launch import train
    from relax.infra.recipe.recipe import load_recipe

    run = "agent" + uuid.uuid4().hex[:6]
    recipe = load_recipe(RECIPES / f"{recipe_name}.yaml", [
        f"bootstrap_servers={broker}", f"run_root={tmp_path}", f"run={run}", *TINY, *overrides])
    lines: list[str] = []
    s = train(recipe, say=lines.append, timeout_s=500)
    assert s["steps"] == 2 and s["balanced"], (s, lines)
    stages = json.loads((Path(s["run_dir"]) / "stages.json").read_text())
    assert not [n for n in stages if n.startswith("reward.")]  # the environment scores
    # a clean end: every stage ended on its own or when asked, and stages.json says so
    assert all(st["finished"] and st["history"][-1].split()[-1] in ("finished", "stopped")
               for st in stages.values()), stages

    bus = BusConfig(bootstrap_servers=broker)
    rollouts = read_table(bus, f"{run}.rollouts").to_pylist()
    rewards = read_table(bus, f"{run}.rewards").to_pylist()
    assert {r["reward_name"] for r in rewards} == {reward}
    by_id = {r["rollout_id"]: r for r in rewards}
    assert set(by_id) == {r["rollout_id"] for r in rollouts}
    for r in rollouts:  # the reward row is the episode's: its step rewards' sum
        steps = json.loads(r["metadata"])["env_rewards"]
        assert by_id[r["rollout_id"]]["value"] == sum(x for x in steps if x is not None)
        assert json.loads(by_id[r["rollout_id"]]["details"]) == {"step_rewards": steps}
        assert r["turns"][0]["role"] == "assistant"
    samples = read_table(bus, f"{run}.train_samples").to_pylist()
    assert samples and all([k for k, _ in r["reward_components"]] == [reward]
                           for r in samples if r["drop_reason"] is None)
    per_step = [ln for ln in lines if ln.startswith("step")]
    assert len(per_step) == 2 and all("reward" in ln for ln in per_step), per_step

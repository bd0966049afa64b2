"""Sync mode (``mode: sync``, ``max_staleness: 0``) through the whole pipeline: every stage
its own process, the real broker, the tiny model. Strictly on-policy: each step trains on
groups sampled with the weights of the step before (docs/architecture.md, section 4)."""

from __future__ import annotations

import uuid

import pytest
from testdata import assert_on_policy, tiny_recipe

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]

STEPS = 4
BATCH_GROUPS = 2
GROUP_SIZE = 4


def test_sync_run_trains_every_sample_on_policy(broker, tmp_path):
    from relax.infra.control.launch import train

    run = "sync" + uuid.uuid4().hex[:6]
    recipe = tiny_recipe(broker, tmp_path, run, "mode=sync", "max_staleness=0",
                         f"trainer.steps={STEPS}", f"batch_groups={BATCH_GROUPS}",
                         f"rollout.group_size={GROUP_SIZE}", "trainer.keep_checkpoints=10")
    assert recipe.rollout.max_staleness == 0 and recipe.trainer.max_staleness == 0
    lines: list[str] = []
    s = train(recipe, say=lines.append, timeout_s=500)
    assert s["steps"] == STEPS and s["balanced"], (s, lines)
    assert s["trained"] + s["stale"] + s["filtered"] + s["errors"] == s["sampled"] > 0, s
    # the rollout stage's credit is one step's groups: nothing is sampled ahead, nothing stale
    assert s["stale"] == 0, s

    assert_on_policy(s, broker, run, STEPS, BATCH_GROUPS, GROUP_SIZE)

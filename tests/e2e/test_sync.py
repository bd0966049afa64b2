"""Sync mode (``mode: sync``, ``max_staleness: 0``) through the whole pipeline: every stage
its own process, the real broker, the tiny model. Strictly on-policy: each step trains on
groups sampled with the weights of the step before (docs/architecture.md, section 4)."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path

import pytest
from testdata import tiny_recipe

from relax.streams.client import BusConfig
from relax.streams.read import read_table
from relax.trainer import checkpoint
from relax.trainer.ledger import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("local_ray")]

STEPS = 4
BATCH_GROUPS = 2
GROUP_SIZE = 4


def test_sync_run_trains_every_sample_on_policy(broker, tmp_path):
    from relax.infra.launch import train

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

    ledger = Ledger.load(checkpoint.latest(Path(s["run_dir"])) / "ledger.parquet")
    assert ledger.counts() == {"trained": s["trained"], "stale": s["stale"],
                               "filtered": s["filtered"], "error": s["errors"]}, s
    trained = {rid: (v, st) for rid, (o, v, st) in ledger.items() if o == "trained"}
    assert trained and all(st == 0 for _, st in trained.values()), trained

    bus = BusConfig(bootstrap_servers=broker)
    samples = {r["rollout_id"]: r for r in read_table(bus, f"{run}.train_samples").to_pylist()}
    assert set(trained) <= set(samples)
    for rid, (version, _) in trained.items():  # sampled with the weights it was trained at
        r = samples[rid]
        assert r["policy_version_start"] == r["policy_version_end"] == version, (rid, r, version)
    # each step's rows were sampled by the weights of the step before: versions 0..STEPS-1,
    # one step's groups each (a filtered row leaves its step short, never another's long)
    per_version = Counter(v for v, _ in trained.values())
    assert set(per_version) == set(range(STEPS)), per_version
    assert all(n <= BATCH_GROUPS * GROUP_SIZE for n in per_version.values()), per_version
    weights = read_table(bus, f"{run}.weights").column("policy_version").to_pylist()
    assert sorted(set(weights)) == list(range(STEPS + 1)), weights
